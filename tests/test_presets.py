"""Presets carry the published shapes: parameter counts against the models' published totals."""

import pytest

from megatron_rl.models.presets import PRESETS, get_preset

# Published parameter counts (Hugging Face model cards / safetensors metadata).
PUBLISHED = {
    "smollm2-135m": 134_515_008,
    "llama-1b": 1_235_814_400,  # Llama 3.2 1B shape
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts(name):
    assert PRESETS[name].num_parameters(tp=1) == PUBLISHED[name]


def test_vocab_padding_is_a_multiple_of_128_times_tp():
    m = get_preset("llama3-8b")
    assert m.padded_vocab_size(1) == 128256
    assert m.padded_vocab_size(8) == 129024
    assert get_preset("tiny").padded_vocab_size(1) == 384
    assert get_preset("tiny").padded_vocab_size(2) == 512


def test_llama3_shapes():
    m = get_preset("llama3-405b")
    assert (m.num_query_groups, m.rotary_base, m.rope_scaling, m.tie_word_embeddings) == (8, 500000.0, True, False)
    assert get_preset("smollm2-135m").tie_word_embeddings
    with pytest.raises(ValueError, match="did you mean 'llama3-70b'"):
        get_preset("llama3-70")
