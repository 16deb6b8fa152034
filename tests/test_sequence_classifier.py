"""The reward executor's model half: a HF LlamaForSequenceClassification on our tensor-parallel GPTModel
(megatron_rl/rewards/sequence_classifier.py) scores as transformers does, and its config check refuses in one line."""

import json
import math
import shutil

import pytest

from megatron_rl.parallel import ParallelLayout
from megatron_rl.launch.spawn import run_local

pytest.importorskip("transformers")

ITEMS = [("the cat ", "sat", None), ("a mat ", "and the cat ran on a mat", None), ("the ", "", None),
         ("cat ", "ran ran", None), ("on a ", "mat and a cat", None)]


def _score_worker(rank, world_size, path, runs):
    """Score each (batch_size, max_length, items) run on a TP=world_size reward model; items on TP rank 0 only."""
    from megatron_rl.parallel import ExecutorPlacement, build_topology
    from megatron_rl.rewards.sequence_classifier import ParallelRewardModel

    g = build_topology([ExecutorPlacement("reward", ParallelLayout(tp=world_size))])["reward"]
    rm = ParallelRewardModel(path, g.layout, g.pgs)
    out = []
    assert rm.max_length == rm.cfg.max_position_embeddings
    for batch_size, max_length, items in runs:
        rm.batch_size, rm.max_length = batch_size, max_length or rm.cfg.max_position_embeddings
        out.append(rm.score(items if g.pgs.tp.rank() == 0 else None))
    names = [n for n, _ in rm.model.named_parameters()]
    return out, names, tuple(rm.head.shape), rm.tokenizer is not None


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    """The tiny reward model's directory and its scores from transformers: each text alone (no padding), and
    RewardModelReward's batches with an empty text and with truncation."""
    import torch
    import transformers
    from test_rewards import _tiny_reward_model

    from megatron_rl.rewards.reward_model import RewardModelReward

    d = tmp_path_factory.mktemp("rm") / "rm"
    model = _tiny_reward_model(d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    alone = []
    for prompt, response, _ in ITEMS:
        with torch.no_grad():
            alone.append(float(model(**tok(prompt + response, return_tensors="pt")).logits[0, 0]))
    empty = ITEMS[:2] + [("", "", None)] + ITEMS[2:]
    batched = RewardModelReward(str(d), batch_size=2).score(empty)
    truncated = RewardModelReward(str(d), batch_size=3, max_length=4).score(ITEMS)
    # Truncation keeps a text's last 4 tokens (the response's end, where the score is read): each text's tail alone.
    tails = []
    for prompt, response, _ in ITEMS:
        with torch.no_grad():
            ids = torch.tensor([tok(prompt + response)["input_ids"][-4:]])
            tails.append(float(model(input_ids=ids).logits[0, 0]))
    assert truncated == pytest.approx(tails, abs=1e-5)
    assert RewardModelReward(str(d)).max_length == model.config.max_position_embeddings
    return d, alone, (empty, batched), truncated


@pytest.mark.parametrize("tp", [1, 2])
def test_scores_match_transformers_at_tp(reward_dir, tp):
    d, alone, (empty, batched), truncated = reward_dir
    # batch_size 3: two batches (3 + 2 texts), each padded to its own longest text.
    runs = [(3, None, ITEMS), (2, None, empty), (3, 4, ITEMS), (3, None, [])]
    results = run_local(_score_worker, tp, str(d), runs)
    assert len(set(round(w, 5) for w in alone)) == len(alone)  # the texts score differently: the test can fail
    for rank, (out, names, head, has_tok) in enumerate(results):
        got, got_empty, got_truncated, none = out
        assert got == pytest.approx(alone, abs=1e-5)
        # Beside an empty text (no tokens: it reads the pad token, which transformers' batch masks out entirely,
        # a case its attention defines its own way) the scores are RewardModelReward's.
        assert got_empty[:2] + got_empty[3:] == pytest.approx(batched[:2] + batched[3:], abs=1e-5)
        assert math.isfinite(got_empty[2])
        assert got_truncated == pytest.approx(truncated, abs=1e-5)
        assert got_truncated != pytest.approx(got, abs=1e-4)  # truncation at max_length changed some scores
        assert none == []
        assert out == results[0][0]  # every rank returns rank 0's list
        assert head == (1, 32) and has_tok == (rank == 0)
        assert not any(n.startswith("output_layer") for n in names)  # no LM head is kept


def _error(path, tp=1) -> str:
    from megatron_rl.rewards.sequence_classifier import reward_model_config

    with pytest.raises(ValueError) as e:
        reward_model_config(path, tp=tp)
    text = str(e.value)
    assert "\n" not in text and f"reward.model={str(path)!r}" in text
    return text


def test_reward_model_config_refuses_in_one_line(reward_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    from test_rewards import _tiny_reward_model
    from tiny_hf import save_tiny_llama

    from megatron_rl.rewards.sequence_classifier import ParallelRewardModel, reward_model_config

    d = reward_dir[0]
    cfg = reward_model_config(d, tp=2)
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.hidden_size, cfg.vocab_size) == (4, 2, 32, 16)
    assert _error(d, tp=3) == (f"reward.model={str(d)!r} has 4 attention heads, which reward.executor.tp=3 does not "
                               f"divide")
    _tiny_reward_model(tmp_path / "two", num_labels=2)
    assert "has 2 outputs (num_labels); a reward model has one" in _error(tmp_path / "two")
    assert "not a Hugging Face model directory (no config.json)" in _error(tmp_path)
    save_tiny_llama(tmp_path / "lm")
    assert "is a LlamaForCausalLM checkpoint, not a sequence classifier" in _error(tmp_path / "lm")
    # A classifier's config over weights without the head.
    shutil.copytree(d, tmp_path / "headless")
    weights = tmp_path / "headless" / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if k != "score.weight"}, weights)
    assert "has no score.weight tensor: it is not a sequence classifier" in _error(tmp_path / "headless")
    shutil.copytree(d, tmp_path / "gpt2")
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert _error(tmp_path / "gpt2") == f"reward.model={str(tmp_path / 'gpt2')!r}: architecture 'gpt2' is not " \
                                        f"supported (supported: llama, qwen2, qwen3, mistral, qwen3_moe, mixtral)"
    moe = json.loads((d / "config.json").read_text()) | {"model_type": "mixtral", "num_local_experts": 4,
                                                        "architectures": ["MixtralForSequenceClassification"]}
    shutil.copytree(d, tmp_path / "moe")
    (tmp_path / "moe" / "config.json").write_text(json.dumps(moe))
    assert _error(tmp_path / "moe") == f"reward.model={str(tmp_path / 'moe')!r}: a mixture-of-experts reward model " \
                                       f"(mixtral) is not supported; use a dense family"
    with pytest.raises(ValueError, match="without pipeline parallelism"):
        ParallelRewardModel(d, ParallelLayout(pp=2), None)
