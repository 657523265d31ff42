"""Classification tasks of the text experiment, and their disjoint seeded splits.

A task is any labelled :class:`~mergeqp.experiments.corpora.Corpus` (``name``, texts, labels);
:func:`default_tasks` builds the experiment's four from the offline corpora:

- ``bbc_topic``: BBC News articles, 5 topics;
- ``wordnet_lexname``: WordNet noun glosses, the ``n_lexnames`` most frequent noun lexicographer
  categories (``noun.artifact``, ``noun.person``, ...);
- ``fortune_category``: fortune quotes, the ``n_fortune`` categories with the most quotes;
- ``wordnet_pos``: WordNet glosses labelled with their part of speech (noun, verb, adj, adv).

:func:`split_task` cuts a task into disjoint, stratified, seeded train / calibration / test parts
(:meth:`Corpus.split`); :func:`check_disjoint` verifies that no text index is in two parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import ValidationError
from .corpora import WORDNET_PARTS, Corpus, bbc_news, fortunes, wordnet_glosses


@dataclass(frozen=True, eq=False)
class TaskSplits:
    """One task's parts: ``train`` (fine-tuning), ``calibration`` (merge statistics and every
    choice the experiment makes) and ``test`` (reported only); ``index[part]`` are the positions
    of its texts in the task's corpus."""

    name: str
    label_names: tuple[str, ...]
    train: Corpus
    calibration: Corpus
    test: Corpus
    index: dict[str, np.ndarray]
    #: texts left out before splitting (:func:`distinct_texts`): ``blank``, ``duplicates`` (copies
    #: beyond the first of a text with one label), ``conflicting`` (every copy of a text given two
    #: or more labels)
    dropped: dict[str, int] = field(default_factory=dict)

    def parts(self) -> dict[str, Corpus]:
        return {"train": self.train, "calibration": self.calibration, "test": self.test}


def _top_labels(corpus: Corpus, n: int, prefix: str = "") -> list[str]:
    counts = {k: v for k, v in corpus.counts().items() if k.startswith(prefix) and v > 0}
    return [k for k, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]


def _renamed(corpus: Corpus, name: str) -> Corpus:
    return Corpus(name, corpus.texts, corpus.labels, corpus.label_names, corpus.source)


def bbc_topic_task() -> Corpus:
    return _renamed(bbc_news(), "bbc_topic")


def wordnet_lexname_task(n_lexnames: int = 6) -> Corpus:
    nouns = wordnet_glosses(parts=("noun",))
    return _renamed(nouns.keep_labels(_top_labels(nouns, n_lexnames, "noun.")), "wordnet_lexname")


def fortune_category_task(n_fortune: int = 4) -> Corpus:
    quotes = fortunes()
    return _renamed(quotes.keep_labels(_top_labels(quotes, n_fortune)), "fortune_category")


def wordnet_pos_task() -> Corpus:
    texts: list[str] = []
    labels: list[int] = []
    source = ""
    for i, part in enumerate(WORDNET_PARTS):
        c = wordnet_glosses(parts=(part,))
        texts.extend(c.texts)
        labels.extend([i] * len(c))
        source = c.source
    return Corpus("wordnet_pos", tuple(texts), np.array(labels), WORDNET_PARTS, source)


#: the experiment's default tasks, each built by a function of no arguments
DEFAULT_TASKS: dict[str, Callable[[], Corpus]] = {
    "bbc_topic": bbc_topic_task,
    "wordnet_lexname": wordnet_lexname_task,
    "fortune_category": fortune_category_task,
    "wordnet_pos": wordnet_pos_task,
}


def default_tasks(names: Sequence[str] | None = None) -> list[Corpus]:
    """The default tasks (all, or those named), read from the offline corpora."""
    chosen = list(names) if names is not None else list(DEFAULT_TASKS)
    bad = [n for n in chosen if n not in DEFAULT_TASKS]
    if bad:
        raise ValidationError(f"unknown text task(s) {bad}; valid: {', '.join(DEFAULT_TASKS)}")
    return [DEFAULT_TASKS[n]() for n in chosen]


def distinct_texts(task: Corpus) -> tuple[np.ndarray, dict[str, int]]:
    """Positions of ``task``'s texts that a split may use, and how many were left out: blank texts;
    copies of a text beyond its first (a copy in train and another in test would be a test text
    the fine-tune was trained on); every copy of a text that carries two or more labels (no
    label is right for it). Texts are compared after stripping surrounding spaces."""
    first: dict[str, int] = {}
    labels_of: dict[str, set[int]] = {}
    blank = 0
    for i, (text, label) in enumerate(zip(task.texts, task.labels.tolist())):
        key = text.strip()
        if not key:
            blank += 1
            continue
        labels_of.setdefault(key, set()).add(int(label))
        first.setdefault(key, i)
    conflicting = {k for k, v in labels_of.items() if len(v) > 1}
    keep = np.array(sorted(i for k, i in first.items() if k not in conflicting), dtype=np.int64)
    copies_conflicting = sum(1 for t in task.texts if t.strip() in conflicting)
    duplicates = len(task) - blank - copies_conflicting - keep.size
    return keep, {"blank": blank, "duplicates": duplicates, "conflicting": copies_conflicting}


def split_task(task: Corpus, train: int, calibration: int, test: int, seed: int) -> TaskSplits:
    """Disjoint stratified parts of ``task`` of (at most) these sizes, seeded, from its distinct
    texts (:func:`distinct_texts`: blank texts, repeated texts and texts with two labels left out,
    counted in ``dropped``). A task smaller than the three parts together uses all of its texts,
    in proportion."""
    keep, dropped = distinct_texts(task)
    distinct = task.subset(keep)
    if len(distinct.label_names) < 2 or len(set(distinct.labels.tolist())) < 2:
        raise ValidationError(f"task {task.name!r}: a classification task needs at least two labels with texts"
                              + (f" ({sum(dropped.values())} of its {len(task)} texts left out: {dropped})"
                                 if sum(dropped.values()) else ""))
    sizes = [train, calibration, test]
    total = sum(sizes)
    if total > len(distinct):
        sizes = [max(1, int(s * len(distinct) / total)) for s in sizes]
    # the split is done on positions, so that the parts' indices can be checked for overlap
    positions = Corpus(task.name, tuple(str(i) for i in range(len(distinct))), distinct.labels, task.label_names,
                       task.source)
    parts = positions.split(sizes, seed=seed)
    # positions in the task's own corpus
    index = {name: keep[np.array([int(t) for t in p.texts], dtype=np.int64)]
             for name, p in zip(("train", "calibration", "test"), parts)}
    check_disjoint(index, task.name)
    subsets = {k: task.subset(v, f"{task.name}:{k}") for k, v in index.items()}
    for k, c in subsets.items():
        if len(c) == 0:
            raise ValidationError(f"task {task.name!r}: its {k} part is empty ({len(distinct)} distinct texts)")
    return TaskSplits(task.name, task.label_names, subsets["train"], subsets["calibration"], subsets["test"], index,
                      dropped)


def check_disjoint(index: dict[str, np.ndarray], name: str) -> None:
    """Raise when a text position is in two parts of ``index``."""
    seen: dict[int, str] = {}
    for part, ix in index.items():
        for i in ix.tolist():
            if i in seen:
                raise ValidationError(f"task {name!r}: text {i} is in both {seen[i]} and {part}")
            seen[i] = part


__all__ = ["DEFAULT_TASKS", "TaskSplits", "check_disjoint", "default_tasks", "distinct_texts", "split_task"]
