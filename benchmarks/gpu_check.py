"""One short, prepared check of the engine on a GPU: correctness against stock transformers, throughput, KV
transfer bandwidth and the serving targets, printed as a table (on the CPU too: ``--device cpu --quick``).

    benchmarks/gpu_check.sh [FLAGS]                       # the GPU machine: tees $OUT/gpu_check.txt and .json
    python benchmarks/gpu_check.py --device cpu --quick   # the same sections on a tiny model, in seconds

The model is a random-weight Llama built here (``common.models.tiny.build_tiny``; ``--size``: tiny, 60m, 350m =
hidden 1024, 24 layers, 16 heads, 8 KV heads, intermediate 2816, vocab 32000; 1b = the same made wider: hidden
2048, 16 layers, intermediate 5632), or ``--model DIR``; bf16 on CUDA, fp32 on the CPU. Engine figures are
in-process (no gRPC, no router): the engine's own ceiling. Sections, each isolated (an error prints one line and
the rest still runs; once ``--deadline-s`` has passed, the remaining ones are skipped with a note):

  env            torch, transformers, device, CUDA
  setup          model build and load, engine start, warm-up
  oracle         engine greedy vs stock ``generate`` on the same weights and dtype, 4 prompts x 64 tokens: the
                 first step's max |logit difference| against a tolerance of twice stock's own error against fp32
                 (+ 1e-2 in bf16/fp16, 1e-4 in fp32), and the first divergence per prompt, which must fall on a
                 near-tie of stock's logits (the two tokens within 2 x tolerance: rounding may flip those only)
  prefill        tokens/s of one 2,048-token prompt, engine and stock forward
  decode         tokens/s of decode steps at batch 1, 16, 64 (stock generate at batch 1, decode only)
  cuda_graphs    decode tokens/s at the same batches with the engine's CUDA graphs on (a second engine on the
                 same weights, its graphs captured by a first pass), against the decode section's; graphs captured;
                 greedy tokens of both engines compared (an error if the graphs switched themselves off)
  kv_transfer    GB/s of the sender's path (export_kv's extraction; staging to host and wire encoding with
                 crc32), the receiver's (checks, write_kv) with an exact round trip, plain device -> host copies,
                 and a NIXL write device -> device between two agents where NIXL is installed, and NIXL block
                 writes (common.kv_transfer.nixl_blocks) from the engine's cache into another on the device
  ttft           16 concurrent 512-token prompts: worst time to first token (target < 500 ms)
  short_requests 512 requests of 64 prompt + 16 new tokens, all at once: requests/s (target > 100)
  stream_rate    16 streams: the slowest stream's tokens/s after its first token (target > 50)

The measurements live in ``benchmarks/gpu_measure.py``. ``--json`` prints one JSON object instead of the table;
``--json-out PATH`` writes it beside the table, rewritten after every section (a run cut short keeps what it
measured). Exit status: 0 when every section ran (a missed target is a result, not an error), else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import gpu_measure  # noqa: E402  (benchmarks/, the script's own directory)
import torch  # noqa: E402
from gpu_measure import SectionError  # noqa: E402

SIZES = ("tiny", "60m", "350m", "1b")
MIN_TRANSFORMERS = (5, 24)  # pyproject.toml's floor
SIZE_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
               intermediate_size=5632)  # fmt: skip


@dataclass(frozen=True)
class Counts:
    """How much each section runs: the full check on a GPU, a few tokens with --quick."""

    oracle_lens: tuple[int, ...]  # one prompt per length
    oracle_new: int
    prefill_len: int
    prefill_repeats: int
    decode_batches: tuple[int, ...]
    decode_prompt: int
    decode_new: int
    kv_prompt: int
    copy_bytes: int
    ttft_requests: int
    ttft_prompt: int
    short_requests: int
    short_prompt: int
    short_new: int
    streams: int
    stream_prompt: int
    stream_new: int
    max_num_seqs: int  # the engine's: "as many at once as fit" for the short requests
    num_kv_blocks: int


FULL = Counts(oracle_lens=(24, 200, 700, 1500), oracle_new=64, prefill_len=2048, prefill_repeats=3,
              decode_batches=(1, 16, 64), decode_prompt=128, decode_new=64, kv_prompt=2048, copy_bytes=256 << 20,
              ttft_requests=16, ttft_prompt=512, short_requests=512, short_prompt=64, short_new=16, streams=16,
              stream_prompt=128, stream_new=64, max_num_seqs=256, num_kv_blocks=4096)  # fmt: skip
QUICK = Counts(oracle_lens=(5, 17, 40, 70), oracle_new=16, prefill_len=128, prefill_repeats=2,
               decode_batches=(1, 4, 8), decode_prompt=16, decode_new=8, kv_prompt=256, copy_bytes=16 << 20,
               ttft_requests=4, ttft_prompt=64, short_requests=16, short_prompt=64, short_new=4, streams=4,
               stream_prompt=16, stream_new=12, max_num_seqs=64, num_kv_blocks=512)  # fmt: skip


@dataclass
class Section:
    """One row of the table and one entry of the JSON."""

    name: str
    status: str = "ok"  # ok | error | skipped
    text: str = ""
    values: dict[str, float] = field(default_factory=dict)  # numbers only
    info: dict = field(default_factory=dict)  # anything else (strings, lists)
    targets: list[dict] = field(default_factory=list)  # {name, value, unit, target, pass}
    seconds: float = 0.0


class GpuCheck:
    """Runs the sections in order and holds what they share: the engine, the stock model, the prompts."""

    def __init__(self, args: argparse.Namespace) -> None:
        from common.engine.loader import resolve_dtype

        self.args = args
        self.t0 = time.monotonic()
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.dtype = resolve_dtype(args.dtype)
        self.counts = QUICK if args.quick else FULL
        self.sections: list[Section] = []
        self.model_dir: Path | None = None
        self.model_desc = ""
        self.built = False  # the model was built here (else --model named an existing directory)
        self._tmp: str | None = None
        self._engine = None
        self._stock = None
        self._fp32 = None
        self._failed: dict[str, str] = {}  # what setup could not build -> why
        self._gen = torch.Generator().manual_seed(0)

    def run(self, name: str, fn: Callable[[Section], None]) -> Section:
        section = Section(name)
        elapsed = time.monotonic() - self.t0
        if elapsed > self.args.deadline_s:
            section.status = "skipped"
            section.text = f"skipped: the global deadline of {self.args.deadline_s:.0f} s passed ({elapsed:.0f} s)"
        else:
            start = time.monotonic()
            try:
                fn(section)
            except Exception as exc:  # noqa: BLE001 - one section's failure must not stop the others
                section.status = "error"
                first_line = str(exc).splitlines()[0] if str(exc) else ""
                section.text = f"ERROR {type(exc).__name__}: {first_line}"[:400]
                traceback.print_exc(file=sys.stderr)
                if self.cuda:
                    torch.cuda.empty_cache()
            section.seconds = time.monotonic() - start
        self.sections.append(section)
        if not self.args.json:
            print(f"{section.name:<15} {section.seconds:6.1f}s  {section.text}", flush=True)
        self.write_json()
        return section

    def result(self) -> dict:
        sections = {s.name: {"status": s.status, "text": s.text, "values": s.values, "info": s.info,
                             "targets": s.targets, "seconds": round(s.seconds, 3)} for s in self.sections}  # fmt: skip
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."), "model": self.model_desc,
                "quick": self.args.quick, "elapsed_s": round(time.monotonic() - self.t0, 2),
                "deadline_s": self.args.deadline_s, "sections": sections}  # fmt: skip

    def write_json(self) -> None:
        if self.args.json_out:
            path = Path(self.args.json_out)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.result(), indent=1) + "\n")

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    # -- what the sections use ------------------------------------------------------------------------------

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @property
    def sections_by_name(self) -> dict[str, Section]:
        """The sections run so far."""
        return {s.name: s for s in self.sections}

    def prompts(self, n: int, length: int) -> list[list[int]]:
        """``n`` random prompts of ``length`` ids from the tokenizer's vocabulary (the lm_head rows past it are 0)."""
        vocab = min(len(self.engine.tokenizer), self.engine.vocab_size)
        return [torch.randint(4, vocab, (length,), generator=self._gen).tolist() for _ in range(n)]

    def greedy(self, n: int):
        from common.engine.sampling_params import SamplingParams

        return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)

    @property
    def engine(self):
        return self._needs("engine", self._engine)

    @property
    def stock(self):
        """The same weights, loaded again, with transformers' own attention."""
        return self._needs("stock model", self._stock)

    def fp32_model(self):
        """The same weights in float32 (the stock model itself when that is float32); loaded on first use."""
        from common.engine.loader import load_model

        if self.dtype == torch.float32:
            return self.stock
        if self._fp32 is None:
            self._fp32 = load_model(self.model_dir, dtype="float32", device=self.device, verify=False).model
        return self._fp32

    def _needs(self, what: str, obj):
        if what in self._failed:
            raise SectionError(f"no {what}: {self._failed[what]}")
        if obj is None:
            raise SectionError(f"no {what}: setup did not run")
        return obj

    # -- the first two sections -----------------------------------------------------------------------------

    def env(self, s: Section) -> None:
        import transformers

        s.info = {"python": platform.python_version(), "torch": torch.__version__,
                  "transformers": transformers.__version__, "cuda": torch.version.cuda or "none",
                  "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch.")}  # fmt: skip
        s.values = {"cuda_available": int(torch.cuda.is_available()), "num_cpus": os.cpu_count() or 0}
        if self.cuda:
            props = torch.cuda.get_device_properties(self.device)
            s.info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                          tf32_matmul=str(torch.backends.cuda.matmul.allow_tf32))  # fmt: skip
            s.values.update(gpu_memory_bytes=props.total_memory, num_gpus=torch.cuda.device_count())
            where = (f"{props.name} ({props.total_memory / 2**30:.0f} GiB, sm {props.major}{props.minor}), "
                     f"CUDA {torch.version.cuda}")  # fmt: skip
        else:
            where = f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads), no CUDA device"
        s.text = f"torch {torch.__version__}, transformers {transformers.__version__}, {where}"
        major_minor = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
        if major_minor < MIN_TRANSFORMERS:  # the engine plugs into transformers 5's attention and loading
            s.text += (f" (the engine needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}, as "
                       "pyproject.toml pins: the sections below may fail on this one)")

    def setup(self, s: Section) -> None:
        from common.engine.config import EngineConfig
        from common.engine.engine import LLMEngine
        from common.engine.loader import load_model

        self._failed = {"engine": "setup failed", "stock model": "setup failed"}  # until each is built
        t = time.monotonic()
        self.model_dir = self._model_dir(s)
        s.values["build_s"] = round(time.monotonic() - t, 2)
        dtype = str(self.dtype).removeprefix("torch.")
        t = time.monotonic()
        loaded = load_model(self.model_dir, dtype=dtype, device=self.device)
        c = self.counts
        config = EngineConfig(num_kv_blocks=c.num_kv_blocks, max_num_seqs=c.max_num_seqs,
                              max_model_len=min(loaded.max_model_len, 4096), prefix_caching=False,
                              max_num_batched_tokens=self.args.max_num_batched_tokens,
                              num_threads=self.args.threads)  # fmt: skip
        self._engine = LLMEngine(loaded, config)
        del self._failed["engine"]
        self._stock = load_model(self.model_dir, dtype=dtype, device=self.device, verify=False).model
        del self._failed["stock model"]
        s.values["load_s"] = round(time.monotonic() - t, 2)
        cfg = loaded.config.get_text_config()
        num_params = sum(p.numel() for p in self._stock.parameters())
        size = self.args.size if self.built else "from --model"
        self.model_desc = (f"{cfg.model_type} {size} ({num_params / 1e6:,.0f}M params, hidden {cfg.hidden_size}, "
                           f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads}/{cfg.num_key_value_heads} "
                           f"heads) {dtype}")  # fmt: skip
        s.values.update(num_params=num_params, kv_blocks=self._engine.block_pool.num_blocks,
                        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens)
        t = time.monotonic()
        warm = self.prompts(2, 16) + self.prompts(1, 64 if self.args.quick else 300)
        self._engine.generate(warm, self.greedy(4))  # first calls allocate and pick kernels
        gpu_measure.last_logits(self._stock, warm[-1], self.device)
        s.values["warmup_s"] = round(time.monotonic() - t, 2)
        s.info["model_dir"] = str(self.model_dir)
        s.text = (f"{self.model_desc}; built in {s.values['build_s']:.1f} s, loaded in {s.values['load_s']:.1f} s, "
                  f"warm-up {s.values['warmup_s']:.1f} s; engine: {config.num_kv_blocks} KV blocks, max_num_seqs "
                  f"{config.max_num_seqs}, step budget {config.max_num_batched_tokens} tokens")  # fmt: skip

    def _model_dir(self, s: Section) -> Path:
        from common.models.tiny import build_tiny

        if self.args.model and Path(self.args.model, "config.json").is_file():
            return Path(self.args.model)
        out = Path(self.args.model) if self.args.model else Path(tempfile.mkdtemp(prefix="gpu-check-"))
        if not self.args.model:
            self._tmp = str(out)
        self.built = True
        size = self.args.size
        try:  # 1b: the 350m preset (bf16, vocab 32000) made wider
            build_tiny("llama", out, size="350m" if size == "1b" else size, overrides=SIZE_1B if size == "1b" else None)
        except RuntimeError as exc:  # another transformers' AutoTokenizer may split text differently
            if not (out / "model.safetensors").is_file():
                raise
            s.info["tokenizer_note"] = f"tokenizer check failed; prompts are token ids, so it does not matter: {exc}"
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, cuda:N")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--size", choices=SIZES, default=None,
                    help="model size (default: 350m on CUDA; tiny on the CPU or with --quick)")
    ap.add_argument("--model", default=None, help="a model directory to use (built there with --size when it has "
                    "no config.json; default: a temporary directory, removed at the end)")
    ap.add_argument("--quick", action="store_true", help="a few tokens per section: a smoke test of seconds")
    ap.add_argument("--deadline-s", type=float, default=220.0, help="sections that would start later are skipped")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the engine's step budget")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on the CPU")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--json-out", default=None, help="also write the JSON to this file")
    args = ap.parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.size = args.size or ("tiny" if args.quick or not cuda else "350m")
    if args.threads and not cuda:
        torch.set_num_threads(args.threads)
    check = GpuCheck(args)
    if not args.json:
        print(f"pdserve GPU check: device {args.device}, {args.dtype}, size {args.size}"
              f"{', quick' if args.quick else ''}, deadline {args.deadline_s:.0f} s", flush=True)  # fmt: skip
    sections = {"env": check.env, "setup": check.setup}
    sections.update({name: lambda s, fn=fn: fn(check, s) for name, fn in gpu_measure.SECTIONS.items()})
    try:
        for name, fn in sections.items():
            check.run(name, fn)
    finally:
        check.close()
    result = check.result()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        targets = [t for s in check.sections for t in s.targets]
        failed = [s.name for s in check.sections if s.status != "ok"]
        print(f"targets: {sum(t['pass'] for t in targets)}/{len(targets)} pass"
              f"{'; not run or failed: ' + ', '.join(failed) if failed else ''}; {result['elapsed_s']:.0f} s in all"
              f"{'' if cuda else '. On the CPU the targets, set for a GPU, say nothing about a deployment'}",
              flush=True)  # fmt: skip
    return 0 if all(s.status == "ok" for s in check.sections) else 1


if __name__ == "__main__":
    sys.exit(main())
