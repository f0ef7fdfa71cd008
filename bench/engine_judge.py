"""The engine evaluators against the in-process engine: the same refresh step, prompts,
drafters and sampler measured by Aerie's engine and by SGLang and vLLM contract servers
started from launch templates (``tests/sglang_contract``, ``tests/vllm_contract``: each
engine's HTTP API in front of Aerie's engine), with τ, its interval, the verify passes and
the seconds of each evaluation.

The world: the evaluation tests' tiny world with tied embeddings (a target that repeats its
prompt's last token), a copy drafter as the candidate and a blurred one as the champion
(``tests/evaluation/test_on_engine.py`` uses the same world).

    python bench/engine_judge.py --prompts 6 --max-new-tokens 32 --json /tmp/engine_judge.json

On a real GPU deployment the engines decode with their own kernels and, for sampled τ,
their own verification coins: there τ agrees in distribution, within the intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.evaluation import stage  # noqa: E402
from pipeline.evaluation.config import EvalConfig  # noqa: E402
from pipeline.evaluation.evaluators import INPROCESS, Evaluator  # noqa: E402
from pipeline.evaluation.servers import EngineServers  # noqa: E402
from tests.evaluation.world import SETTINGS, eval_world, publish_drafter_dir  # noqa: E402
from tests.sglang_contract.drafters import save_copy_drafter  # noqa: E402

LAUNCHES = {
    "sglang": (sys.executable, "-m", "tests.sglang_contract.server", "--model", "{policy_dir}",
               "--port", "{port}", "{speculative_args}"),
    "vllm": (sys.executable, "-m", "tests.vllm_contract.completions_server", "{policy_dir}",
             "--port", "{port}", "{speculative_args}"),
}
SAMPLERS = ({}, {"temperature": 0.03, "top_p": 0.9})  # greedy, then sampled


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    os.chdir(ROOT)  # the templates run the contract servers as modules of this checkout
    root = Path(tempfile.mkdtemp(prefix="aerie-engine-judge-"))
    storage, target = eval_world(root / "storage", tie=True)
    vocab = target.config.vocab_size
    drafters = {name: publish_drafter_dir(
        storage, save_copy_drafter(target, root / name, [list(range(vocab))],
                                   draft_vocab=vocab, noise=noise), f"drafters/{name}", 2,
        f"fp-{name}") for name, noise in (("candidate", 0.0), ("champion", 1.0))}
    evaluators = {"inprocess": INPROCESS, **{
        kind: Evaluator(kind, EngineServers(launch=launch, health_timeout_s=300))
        for kind, launch in LAUNCHES.items()}}
    rows = []
    for sampler in SAMPLERS:
        config = EvalConfig(max_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                            **SETTINGS, **sampler)
        for kind, evaluator in evaluators.items():
            r = stage.run(storage, 2, drafters["candidate"], drafters["champion"], config,
                          evaluator)
            row = {"regime": r.regime, "evaluator": kind, "seconds": round(r.seconds, 1),
                   **{name: {"tau": round(c.tau, 4),
                             "interval": [round(x, 4) for x in c.tau_interval],
                             "verify_passes": sum(p[1] for p in c.per_prompt),
                             "per_prompt": c.per_prompt}
                      for name, c in r.contestants.items()}}
            rows.append(row)
            print(f"{row['regime']:>16} {kind:>9}: " + ", ".join(
                f"{n} τ {row[n]['tau']:.4f} [{row[n]['interval'][0]:.4f}, "
                f"{row[n]['interval'][1]:.4f}] over {row[n]['verify_passes']} passes"
                for n in ("candidate", "champion")) + f"; {row['seconds']} s")
    for regime in {r["regime"] for r in rows}:
        mine = [r for r in rows if r["regime"] == regime]
        same = all(r[n]["per_prompt"] == mine[0][n]["per_prompt"]
                   for r in mine for n in ("candidate", "champion", "no_drafter"))
        print(f"{regime}: per-prompt counts equal across evaluators: {same}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
