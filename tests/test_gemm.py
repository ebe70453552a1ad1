"""GEMM tactics (backend/engine/runners/gemm.py): each one, forced, against HF within a stated tolerance, so a
tactic this machine never picks is still tested; the measured choice is cached and reused by every later process,
so all of them compute the same numbers.

Tolerances on the last-token logits of every prompt (max |difference| per prompt):
- float32 tactics vs HF float32: 1e-3 (a tactic only reorders float32 sums; logits here have std ~4).
- bfloat16 tactics vs HF float32: at most 2x HF's own bfloat16 difference from HF float32, plus 0.05.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

from backend.engine.batch import build_model_input
from backend.engine.kernels import cpu_kernels
from backend.engine.kv_cache import KVCacheManager
from backend.engine.runners import gemm
from backend.engine.runners.torch_runner import TorchRunner
from backend.engine.sampling import SamplingParams
from backend.engine.sequence import Sequence

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 300, 42], [7] * 37, list(range(100, 160)), [1000 + 3 * i for i in range(129)]]
BLOCK_SIZE = 16


def engine_logits(runner: TorchRunner) -> torch.Tensor:
    """The runner's last-token logits of PROMPTS, prefilled together in one flat batch."""
    kv = KVCacheManager(runner.num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
    seqs = [Sequence(str(i), p, SamplingParams(), arrival_index=i) for i, p in enumerate(PROMPTS)]
    for seq in seqs:
        assert kv.allocate(seq, seq.num_tokens)
    return runner.forward(build_model_input([(s, s.num_tokens) for s in seqs], BLOCK_SIZE, q_tile=16))


def hf_logits(model_dir, dtype: torch.dtype) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).eval()
    with torch.inference_mode():
        return torch.stack([model(torch.tensor([p])).logits[0, -1].float() for p in PROMPTS])


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir) -> dict[torch.dtype, torch.Tensor]:
    return {dtype: hf_logits(tiny_model_dir, dtype) for dtype in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tactic", [n for n, t in gemm.TACTICS.items() if t.quantization == "none"])
def test_each_tactic_forced_matches_hf_within_tolerance(tiny_model_dir, hf_reference, tactic, dtype):
    torch_dtype = getattr(torch, dtype)
    if tactic not in gemm.candidates(torch_dtype, torch.device("cpu")):
        with pytest.raises(ValueError, match=f"gemm_backend: {tactic} cannot run {dtype} on this cpu .*; candidates"):
            TorchRunner(tiny_model_dir, dtype, 64, BLOCK_SIZE, gemm_backend=tactic)
        return
    runner = TorchRunner(tiny_model_dir, dtype, 64, BLOCK_SIZE, gemm_backend=tactic)
    assert set(runner.gemm_tactics.values()) == {tactic}
    diff = (engine_logits(runner) - hf_reference[torch.float32]).abs().amax(dim=-1)
    if dtype == "float32":
        assert diff.max() < 1e-3, diff
    else:
        hf_own = (hf_reference[torch.bfloat16] - hf_reference[torch.float32]).abs().amax(dim=-1)
        assert (diff <= 2 * hf_own + 0.05).all(), (diff, hf_own)


@pytest.mark.parametrize("m,n,k", [(1, 64, 32), (5, 100, 96), (6, 16, 7), (13, 960, 576), (40, 130, 33), (70, 200, 64),
                                   (301, 200, 600)])
def test_f32_panels_is_a_float32_linear_at_every_row_and_panel_count(m, n, k):
    """Rows past whole microkernels (6), a last panel narrower than the others, any in_features, an x of more than
    512 KB (taken in parts of rows, the last one ending in a partial microkernel); with a bias and a bfloat16 or
    float16 model (its weight kept in its 16 bits and widened as loaded: the same float32 sums as from a float32 copy,
    rounded once), through the tactic as the runner prepares it."""
    torch.manual_seed(m * n + k)
    x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
    exact = (x.double() @ w.double().T + b.double()).float()
    got = gemm.TACTICS["f32_panels"].prepare(w, b)(x)
    assert got.shape == (m, n) and torch.allclose(got, exact, rtol=1e-5, atol=1e-4 * k ** 0.5)
    for dtype in (torch.bfloat16, torch.float16):
        xb, wb, bb = x.to(dtype), w.to(dtype), b.to(dtype)
        tactic = gemm.TACTICS["f32_panels"].prepare(wb, bb)
        assert [t.dtype for t in tactic.gemm.panels] == [dtype]  # half the bytes of a float32 copy, read and held
        narrow = tactic(xb)
        assert narrow.dtype == dtype and torch.equal(  # float32's result rounded once
            narrow, (gemm.TACTICS["f32_panels"].prepare(wb.float(), bb.float())(xb.float())).to(dtype))
        assert torch.allclose(narrow.float(), F.linear(xb.float(), wb.float(), bb.float()), rtol=2 ** -8,
                              atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_stored_in_its_dtype_keeps_no_mapping_of_its_files(tiny_model_dir, tmp_path, dtype):
    """Files in the model's own dtype load as tensors on their mappings. The f32_panels tactic packs every Linear's
    weight (and drops it); the embedding and norms are copies: no page of the files stays mapped (a bfloat16 1B held
    2.3 GB of them beside its packed weights)."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    for f in folder.glob("*.safetensors"):
        save_file({k: v.to(dtype, copy=True) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    runner = TorchRunner(folder, str(dtype).removeprefix("torch."), 64, BLOCK_SIZE, gemm_backend="f32_panels")
    assert set(runner.gemm_tactics.values()) == {"f32_panels"}
    gc.collect()
    assert str(folder) not in Path("/proc/self/maps").read_text()
    assert engine_logits(runner).isfinite().all()


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
def test_a_16_bit_folder_in_a_float32_model_keeps_its_linears_16_bits(tiny_model_dir, tmp_path, monkeypatch, narrow):
    """A checkpoint in bfloat16/float16 served at `dtype: float32`: f32_panels holds its Linears' weights as stored
    (half a float32 copy's bytes) and computes what the same values stored in float32 compute, bit for bit; a tactic
    that does not read 16 bits (aten: the exported graph's) gets the float32 copy at load, the same numbers; neither
    keeps the files mapped; the race times the tactics on the weights as stored."""
    monkeypatch.setenv("LLM_KERNEL_CACHE", str(tmp_path / "kernels"))
    folders = {}
    for dtype in (narrow, torch.float32):
        folders[dtype] = folder = tmp_path / str(dtype)
        shutil.copytree(tiny_model_dir, folder)
        for f in folder.glob("*.safetensors"):  # float32 holds the 16-bit values exactly
            save_file({k: v.to(narrow).to(dtype) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    for tactic in ("f32_panels", "aten"):
        served, wide = (TorchRunner(folders[d], "float32", 64, BLOCK_SIZE, gemm_backend=tactic) for d in folders)
        gc.collect()
        assert str(folders[narrow]) not in Path("/proc/self/maps").read_text()  # no page of its files held
        qkv = served.model.get_submodule("layers.0.qkv_proj")
        if tactic == "f32_panels":
            assert qkv.weight is None and [p.dtype for p in qkv.gemm.gemm.panels] == [narrow]
        else:
            assert qkv.weight.dtype == torch.float32
        assert torch.equal(engine_logits(served), engine_logits(wide))
    runner = TorchRunner(folders[narrow], "float32", 64, BLOCK_SIZE)
    table = json.loads(gemm.cache_file().read_text())
    assert table and all(key.startswith(f"float32<-{str(narrow).removeprefix('torch.')}/") for key in table)
    assert engine_logits(runner).isfinite().all()


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (5, 100, 96), (16, 64, 64), (17, 20, 7), (48, 960, 576),
                                   (70, 200, 33), (130, 48, 64)])
def test_bf16_amx_is_a_bfloat16_linear_at_every_row_and_panel_count(m, n, k):
    """Rows past whole tiles (16) and past the 64 rows that share a B tile, a last panel narrower than 16 channels,
    in_features past whole k-blocks (32), a bias: float32 sums of exact bfloat16 products, rounded once. Where the CPU
    has no AMX-BF16, the tactic is no candidate and refused by name."""
    torch.manual_seed(m * n + k)
    x, w, b = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    if "bf16_amx" not in gemm.candidates(torch.bfloat16, torch.device("cpu")):
        assert "AMX" in gemm.why_not("bf16_amx", torch.bfloat16)
        return
    exact = x.double() @ w.double().T + b.double()
    for bias in (b, None):
        got = gemm.TACTICS["bf16_amx"].prepare(w, bias)(x)
        want = exact if bias is not None else exact - b.double()
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert torch.allclose(got.double(), want, rtol=2 ** -8, atol=1e-5 * k ** 0.5)
    strided = torch.randn(m, 2 * k).bfloat16()[:, ::2]  # not contiguous: read through the padded copy
    assert torch.equal(gemm.TACTICS["bf16_amx"].prepare(w, b)(strided),
                       gemm.TACTICS["bf16_amx"].prepare(w, b)(strided.contiguous()))


def test_auto_choice_is_measured_once_and_cached(tiny_model_dir, tmp_path, monkeypatch):
    """The first start times the tactics and writes the table; the next one reads it and writes nothing."""
    monkeypatch.setenv("LLM_KERNEL_CACHE", str(tmp_path / "kernels"))
    cache = gemm.cache_file()
    runner = TorchRunner(tiny_model_dir, "float32", 64, BLOCK_SIZE, gemm_backend="auto")
    assert cache.parent == tmp_path / "gemm" and cache.is_file()
    table = json.loads(cache.read_text())
    assert {v["choice"] for v in table.values()} <= set(gemm.candidates(torch.float32, torch.device("cpu")))
    assert len(table) == len(set(runner.gemm_tactics)) and all(len(v["us_per_token"]) >= 2 for v in table.values())
    written = cache.stat().st_mtime_ns
    again = TorchRunner(tiny_model_dir, "float32", 64, BLOCK_SIZE, gemm_backend="auto")
    assert again.gemm_tactics == runner.gemm_tactics and cache.stat().st_mtime_ns == written


CHOOSE = """
import json, logging, sys
import torch
from backend.engine.runners import gemm
logging.basicConfig(level=logging.INFO)
shapes = [gemm.Shape(512, 256, (16, 64)), gemm.Shape(256, 512, (16, 64))]
print(json.dumps(sorted(gemm.choose(shapes, torch.float32, torch.device("cpu"), quantization=sys.argv[1]).values())))
"""


def test_processes_timing_at_once_beside_a_busy_one_make_the_same_choices(tmp_path):
    """Tactics round differently, so every process on a machine must pick the same ones, however busy the CPUs were
    when they timed them. Two processes start at once beside a real busy process (two small shapes, int8's three
    tactics): one times under the file lock, warns that others took CPUs,
    and caches its choices all the same; the other waits and serves them, so both return the same."""
    (tmp_path / "kernels").symlink_to(cpu_kernels.library_path().parents[1])  # this run's kernels, a fresh gemm/
    env = {**os.environ, "LLM_KERNEL_CACHE": str(tmp_path / "kernels"), "PYTHONPATH": str(REPO)}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        procs = [subprocess.Popen([sys.executable, "-c", CHOOSE, "int8"], env=env, cwd=REPO, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        busy.kill()
        busy.wait()
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    [first, second] = [json.loads(out) for out, _ in outs]
    assert first == second and set(first) <= set(gemm.candidates(torch.float32, torch.device("cpu"), "int8"))
    warnings = [err for _, err in outs if "other processes used" in err]
    timed = [err for _, err in outs if "gemm: timing" in err]
    assert len(timed) == 1 and warnings == timed and "cached all the same" in warnings[0]
    table = json.loads((tmp_path / "gemm" / gemm.cache_file().name).read_text())
    assert len(table) == 2 and all(row["others_cpus"] > gemm.CONTENDED_CPUS for row in table.values())


def test_unknown_backend_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="gemm_backend: expected one of"):
        TorchRunner(tiny_model_dir, "float32", 64, BLOCK_SIZE, gemm_backend="mkl")


def test_a_tactic_this_cpu_cannot_run_is_no_candidate_and_refused_by_name(tiny_model_dir):
    """oneDNN's bfloat16 path needs avx512bw/vl/dq (or avx_ne_convert); `ONEDNN_MAX_CPU_ISA=AVX2` takes them away
    on any CPU, as an AVX2-only CPU (AMD Zen 3) lacks them. Run in a fresh process: oneDNN reads it at start."""
    code = (
        "import torch\n"
        "from backend.engine.runners import gemm\n"
        "from backend.engine.runners.torch_runner import TorchRunner\n"
        "names = gemm.candidates(torch.bfloat16, torch.device('cpu'))\n"
        "assert 'onednn' not in names and 'onednn_f32' in names, names\n"
        f"try:\n    TorchRunner({str(tiny_model_dir)!r}, 'bfloat16', 64, 16, gemm_backend='onednn')\n"
        "except ValueError as err:\n    print(err)\n"
        "runner = TorchRunner(" + repr(str(tiny_model_dir)) + ", 'bfloat16', 64, 16, gemm_backend='auto')\n"
        "print(sorted(set(runner.gemm_tactics.values())))\n")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refusal, chosen = proc.stdout.strip().splitlines()[-2:]
    assert refusal.startswith("gemm_backend: onednn cannot run bfloat16 on this cpu (") and "avx512bw" in refusal
    amx = ["bf16_amx"] if gemm.why_not("bf16_amx", torch.bfloat16) is None else []  # ours: no oneDNN in it
    assert f"candidates: {['aten', 'f32_panels', *amx, 'aten_f32', 'onednn_f32']}" in refusal
    assert "'onednn'" not in chosen, chosen
