import pytest

from openrlhf_lpo.megatron.parallel_layout import validate_layout

CFG = {"num_attention_heads": 40, "num_key_value_heads": 8, "num_hidden_layers": 40,
       "intermediate_size": 17408, "vocab_size": 151936}  # Qwen3-14B


def test_valid_14b_layouts():
    lay = validate_layout(16, 8, 2, CFG)
    assert (lay.tp, lay.pp, lay.dp) == (8, 2, 1)
    assert validate_layout(8, 4, 1, CFG).dp == 2


@pytest.mark.parametrize(
    "world,tp,pp,needle",
    [
        (6, 4, 1, "world size 6"),
        (24, 3, 1, "num_key_value_heads=8"),
        (24, 1, 3, "num_hidden_layers=40"),
        (0, 1, 1, "world size"),
        (8, 0, 1, "--megatron.tp"),
    ],
)
def test_bad_layouts_name_the_numbers(world, tp, pp, needle):
    with pytest.raises(ValueError, match=needle.replace("+", r"\+")):
        validate_layout(world, tp, pp, CFG)


def test_message_names_both_flags():
    with pytest.raises(ValueError) as e:
        validate_layout(6, 2, 2, CFG)
    msg = str(e.value)
    assert "--megatron.tp 2" in msg and "--megatron.pp 2" in msg and "6" in msg


def test_vocab_and_vpp():
    with pytest.raises(ValueError, match="vocab_size=151937"):
        validate_layout(2, 2, 1, dict(CFG, vocab_size=151937, num_key_value_heads=2))
    with pytest.raises(ValueError, match="--megatron.vpp"):
        validate_layout(4, 1, 1, CFG, vpp=2)
