"""An encoder-decoder base whose decoder needs inputs of its own (T5) is refused at plan time, with
the reason (stop 55 review: the run failed after loading every model, blaming the prompts); one
that derives them from ``input_ids`` (BART) passes the same probe. The probe is one forward pass of
the ``meta``-device skeleton."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mergeqp.errors import ConfigError  # noqa: E402
from mergeqp.run.plan import _check_decoder_inputs  # noqa: E402


def _skeleton(cls, config):
    with torch.device("meta"):
        return cls(config)


def test_t5_is_refused_at_plan_time_and_bart_passes():
    t5 = transformers.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                               pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    with pytest.raises(ConfigError, match="t5.*encoder-decoder.*not supported"):
        _check_decoder_inputs(_skeleton(transformers.T5ForConditionalGeneration, t5), t5.to_dict())
    bart = transformers.BartConfig(vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1,
                                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                   decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=0,
                                   bos_token_id=2, eos_token_id=1, decoder_start_token_id=1)
    _check_decoder_inputs(_skeleton(transformers.BartForConditionalGeneration, bart), bart.to_dict())
    llama = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2)
    _check_decoder_inputs(_skeleton(transformers.LlamaForCausalLM, llama), llama.to_dict())  # not one: no probe
