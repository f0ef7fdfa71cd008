"""What one SGLang hidden-state answer costs to serialise (server) and to decode (client).

A ``/generate`` answer of ``--tokens`` prompt tokens at ``--hidden`` × ``--layers`` floats per
row (EAGLE-3 aux capture; synthetic N(0, σ²) states rounded to ``--dtype`` as the model runs)
is built exactly as SGLang 0.5.23 builds it, then decoded by the client, one core, each way
timed in CPU seconds (``time.process_time``), interleaved per repetition:

- client ``json.loads``: the stdlib decoder, then the backend's validation into a float32
  tensor (``parse_generate_response``): Aerie's path before #18;
- client ``orjson.loads``: the same with orjson (the fastest float-object decoder here);
- client ``simdjson``: ``loads_generate`` (simdjson, each prefill block copied into an array),
  then the same validation: Aerie's path now.

Each client way is checked to give the same tensor bit for bit. Server side, the steps SGLang
runs for one prefill block (sources: docs/sglang.md, "What a hidden state costs the server"):
``tensor.tolist()`` in the scheduler, pickle through ZMQ to the detokenizer and on to the
tokenizer manager (dump, load, dump, load), and ``orjson.dumps`` in the HTTP process.

Beside it, the whole per-token cost of one capture (aux and final states) both ways: SGLang's
two answers (an aux body of ``layers·H`` and a final body of ``H`` floats) decoded with
simdjson, vs one vLLM ``extract_hidden_states`` file (``[T, layers + 1, H]``, bf16 as vLLM
writes it) read by the ``vllm`` backend (safetensors load from a page-cached file,
validation, the final norm) — and the server side of the file (``save_file``).

Prints tokens/s per core, CPU seconds per 1k tokens and the ratio to ``json.loads``; writes
the rows as JSON with ``--json``.

    python bench/sglang_decode.py --tokens 512 --hidden 4096 --layers 3 --reps 5
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.capture.final_norm import FinalNorm  # noqa: E402
from pipeline.capture.sglang import parse_generate_response  # noqa: E402
from pipeline.capture.sglang_decode import loads_generate  # noqa: E402
from pipeline.capture.vllm import VLLMCaptureConfig  # noqa: E402

SGLANG_ORJSON = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY  # json_response.py
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def states(tokens: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, width, generator=g) * 0.5).to(dtype)


def answer(block: list[list[float]]) -> dict[str, Any]:
    """One ``/generate`` output as SGLang's tokenizer manager hands it to orjson."""
    return {"text": " the", "output_ids": [279],
            "meta_info": {"id": "0f3c", "finish_reason": {"type": "length", "length": 1},
                          "prompt_tokens": len(block), "completion_tokens": 1,
                          "cached_tokens": 0, "hidden_states": [block]}}


def server_steps(rows: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """The serialisation steps of one prefill block, in SGLang's order."""
    block = rows.tolist()
    dumped = pickle.dumps(block, protocol=pickle.HIGHEST_PROTOCOL)
    return {
        "tolist (scheduler)": rows.tolist,
        "pickle.dumps (scheduler)": lambda: pickle.dumps(block, pickle.HIGHEST_PROTOCOL),
        "pickle.loads+dumps (detokenizer)": lambda: pickle.dumps(
            pickle.loads(dumped), pickle.HIGHEST_PROTOCOL),
        "pickle.loads (tokenizer manager)": lambda: pickle.loads(dumped),
        "orjson.dumps (HTTP)": lambda: orjson.dumps([answer(block)], option=SGLANG_ORJSON),
    }


def client_ways(body: bytes, tokens: int, width: int, hidden: int
                ) -> dict[str, Callable[[], torch.Tensor]]:
    def validate(decoded: Any) -> torch.Tensor:
        [rows] = parse_generate_response(decoded, url="bench", samples=[0], lengths=[tokens],
                                         width=width, role="aux", hidden_size=hidden)
        return rows

    return {"json.loads": lambda: validate(json.loads(body)),
            "orjson.loads": lambda: validate(orjson.loads(body)),
            "simdjson": lambda: validate(loads_generate(body))}


def both_states(args: argparse.Namespace, aux_rows: torch.Tensor, files: Path
                ) -> dict[str, Callable[[], Any]]:
    """aux + final of ``--tokens`` tokens: SGLang's two bodies vs vLLM's one file."""
    from safetensors.torch import save_file

    h, t = args.hidden, args.tokens
    final = states(t, h, DTYPES[args.dtype], args.seed + 1)
    final_body = orjson.dumps([answer(final.tolist())], option=SGLANG_ORJSON)
    aux_body = orjson.dumps([answer(aux_rows.tolist())], option=SGLANG_ORJSON)
    stacked = torch.cat([aux_rows.view(t, args.layers, h), final.view(t, 1, h)], dim=1)
    tensors = {"hidden_states": stacked.contiguous(),
               "token_ids": torch.arange(t, dtype=torch.long)}
    path = files / "bench.safetensors"
    save_file(tensors, str(path))
    backend = VLLMCaptureConfig(urls=["http://127.0.0.1:9"], files_dir=str(files),
                                hidden_size=h, aux_layer_ids=tuple(range(args.layers)),
                                num_target_layers=args.layers + 2,
                                final_norm=FinalNorm(torch.ones(h), 1e-6)).build()
    ids = list(range(t))

    def sglang() -> None:
        for body, width in ((aux_body, args.layers * h), (final_body, h)):
            parse_generate_response(loads_generate(body), url="bench", samples=[0],
                                    lengths=[t], width=width, role="aux", hidden_size=h)

    return {"sglang: 2 bodies, simdjson": sglang,
            "vllm: 1 file, read + norm": lambda: backend._states(path, 0, ids),
            "vllm server: save_file": lambda: save_file(tensors, str(path))}


def cpu_seconds(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def measure(ways: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median CPU seconds per way, the ways interleaved within each repetition."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(reps):
        for name, fn in ways.items():
            times[name].append(cpu_seconds(fn)[0])
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=3, help="aux layers per row")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # per core
    width = args.hidden * args.layers
    rows = states(args.tokens, width, DTYPES[args.dtype], args.seed)
    body = orjson.dumps([answer(rows.tolist())], option=SGLANG_ORJSON)
    client = client_ways(body, args.tokens, width, args.hidden)
    outputs = {name: fn() for name, fn in client.items()}  # warm-up and the equality check
    reference = rows.to(torch.float32)
    for name, out in outputs.items():
        if not torch.equal(out, reference):
            raise SystemExit(f"{name} decoded different values")
    del outputs
    report: dict[str, Any] = {
        "command": " ".join(["python", "bench/sglang_decode.py", *(argv or sys.argv[1:])]),
        "tokens": args.tokens, "width": width, "dtype": args.dtype,
        "json_bytes_per_token": len(body) / args.tokens, "client": {}, "server": {}}
    print(f"{args.tokens} tokens × {width} floats ({args.dtype}); "
          f"{len(body) / args.tokens / 1024:.1f} KiB of JSON per token")
    client_s = measure(client, args.reps)
    base = client_s["json.loads"]
    print(f"{'client (one core)':<34} {'tokens/s':>10} {'CPU s/1k tok':>13} {'vs json':>8}")
    for name, s in client_s.items():
        row = {"tokens_per_s": args.tokens / s, "cpu_s_per_1k_tokens": 1000 * s / args.tokens,
               "speedup_vs_json_loads": base / s}
        report["client"][name] = row
        print(f"{name:<34} {row['tokens_per_s']:>10.0f} {row['cpu_s_per_1k_tokens']:>13.3f} "
              f"{row['speedup_vs_json_loads']:>7.1f}x")
    server_s = measure(server_steps(rows), args.reps)
    print(f"{'server (SGLang 0.5.23 steps)':<34} {'':>10} {'CPU s/1k tok':>13}")
    for name, s in server_s.items():
        report["server"][name] = {"cpu_s_per_1k_tokens": 1000 * s / args.tokens}
        print(f"{name:<34} {'':>10} {1000 * s / args.tokens:>13.3f}")
    total = sum(server_s.values())
    http = server_s["pickle.loads (tokenizer manager)"] + server_s["orjson.dumps (HTTP)"]
    report["server"]["total"] = {"cpu_s_per_1k_tokens": 1000 * total / args.tokens}
    report["server"]["http_process"] = {"cpu_s_per_1k_tokens": 1000 * http / args.tokens,
                                        "tokens_per_s": args.tokens / http}
    print(f"{'total (three processes)':<34} {'':>10} {1000 * total / args.tokens:>13.3f}")
    print(f"one server's HTTP process caps at {args.tokens / http:.0f} tokens/s")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None
                                     ) as files:
        both = measure(both_states(args, rows, Path(files)), args.reps)
    print(f"{'aux + final, per capture':<34} {'tokens/s':>10} {'CPU s/1k tok':>13}")
    report["aux_and_final"] = {}
    for name, s in both.items():
        report["aux_and_final"][name] = {"tokens_per_s": args.tokens / s,
                                         "cpu_s_per_1k_tokens": 1000 * s / args.tokens}
        print(f"{name:<34} {args.tokens / s:>10.0f} {1000 * s / args.tokens:>13.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
