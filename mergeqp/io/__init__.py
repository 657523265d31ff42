"""Checkpoints and calibration data on disk.

- :func:`open_checkpoint`: a read-only, lazily loaded view of a Hugging Face folder (sharded or
  not), a ``.safetensors`` file or a torch state-dict file (:class:`Checkpoint`);
- :func:`save_hf_folder`: stream tensors into a Hugging Face folder (sharded safetensors above a
  size, config and tokenizer files copied) that ``AutoModel*.from_pretrained`` loads;
- :mod:`.calibration`: prompt files -> tokenised batches (:func:`read_prompts`,
  :func:`tokenize_batches`, :func:`split_holdout`).

See ``docs/hf.md``.
"""

from __future__ import annotations

from .calibration import Batch, read_prompts, split_holdout, tokenize_batches
from .checkpoint import Checkpoint, TensorInfo, open_checkpoint
from .writer import WrittenModel, parse_size, save_hf_folder

__all__ = [
    "Batch",
    "Checkpoint",
    "TensorInfo",
    "WrittenModel",
    "open_checkpoint",
    "parse_size",
    "read_prompts",
    "save_hf_folder",
    "split_holdout",
    "tokenize_batches",
]
