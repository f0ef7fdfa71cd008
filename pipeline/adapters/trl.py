"""TRL's ``GRPOTrainer`` (and ``RLOOTrainer``) writing Aerie snapshots as it trains.

TRL hands every reward function the ids it sampled (``completion_ids``) and the trainer's
state, once per generation batch; a ``TrainerCallback`` sees the training arguments. So the
recorder wraps the user's reward functions: each wrapped function computes its reward as
before, and once every one has scored a batch the recorder writes the batch as the snapshot
of ``trainer_state.global_step``: prompt ids rebuilt with the chat template exactly as TRL
builds them (``apply_chat_template(..., add_generation_prompt=True, tokenize=True)``), the
sampled ids, the weighted reward TRL optimises (its ``nansum`` over ``reward_weights``), the
sampler from ``GRPOConfig``, and as policy the checkpoint of that step (``checkpoint-{N}``,
the policy after N optimizer steps, which is what generated the batch) or the newest saved
before it, or the initial policy at step 0.

Usage (the whole change to a TRL script)::

    recorder = TRLRecorder(Storage(url), tokenizer=tok, initial_policy_dir=model_dir,
                           reward_funcs=[accuracy, format_reward])
    trainer = GRPOTrainer(model=model_dir, reward_funcs=recorder.reward_funcs, args=args,
                          train_dataset=ds, processing_class=tok, callbacks=[recorder.callback])

Refused with a clear error rather than recorded wrongly: more than one process (each rank
would write a different slice as the same step), evaluation during training (its batches
would overwrite the step's snapshot), tool-calling completions (TRL does not pass reward
functions the mask of tool-result tokens), and reward models given by name (the recorder
can only wrap callables).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase, TrainerCallback

from pipeline.adapters.checkpoints import policy_checkpoint
from pipeline.snapshot.sieve import SnapshotSummary
from pipeline.snapshot.writer import SnapshotWriter
from pipeline.storage import Storage

log = logging.getLogger(__name__)

CHECKPOINT_PATTERN = "checkpoint-{N}"  # HF Trainer's save directories under output_dir


class TRLRecorderError(RuntimeError):
    """The TRL run is set up in a way the recorder would record wrongly."""


class TRLRecorder:
    """Wraps a TRL run's reward functions and records every generation batch as a snapshot.

    ``reward_weights`` are TRL's (``GRPOConfig.reward_weights``; None = all 1.0): the
    recorded reward is the same weighted sum the trainer computes.
    """

    def __init__(self, storage: Storage, *, tokenizer: PreTrainedTokenizerBase,
                 initial_policy_dir: str | Path, reward_funcs: Sequence[Callable[..., Any]],
                 reward_weights: Sequence[float] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None):
        funcs = list(reward_funcs)
        if not funcs:
            raise ValueError("TRLRecorder needs at least one reward function to wrap")
        for f in funcs:
            if not callable(f) or isinstance(f, str):
                raise TRLRecorderError(
                    f"reward function {f!r} is not a callable: the recorder wraps callables "
                    "only (load a reward model yourself and score in a function)")
        if reward_weights is not None and len(reward_weights) != len(funcs):
            raise ValueError(f"{len(reward_weights)} reward weights for {len(funcs)} functions")
        self.writer = SnapshotWriter(storage)
        self.tokenizer = tokenizer
        self.initial_policy_dir = Path(initial_policy_dir)
        self.weights = [1.0] * len(funcs) if reward_weights is None else list(reward_weights)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.reward_funcs = [self._wrap(i, f) for i, f in enumerate(funcs)]
        self.callback = _Callback(self)
        self.args: Any = None  # the TrainingArguments, set when training begins
        self.written: list[SnapshotSummary] = []
        self._pending: dict[int, list[Any]] = {}  # id(completion_ids) -> rewards per func

    # -- reward-function side -------------------------------------------------------------

    def _wrap(self, index: int, func: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
                rewards = await func(*args, **kwargs)
                self._scored(index, rewards, kwargs)
                return rewards
            return wrapped_async

        @functools.wraps(func)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            rewards = func(*args, **kwargs)
            self._scored(index, rewards, kwargs)
            return rewards
        return wrapped

    def _scored(self, index: int, rewards: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("completion_ids")
        if ids is None or "trainer_state" not in kwargs:
            raise TRLRecorderError("the wrapped reward function was called without "
                                   "completion_ids/trainer_state: is this a TRL GRPO/RLOO run?")
        batch = self._pending.setdefault(id(ids), [None] * len(self.reward_funcs))
        batch[index] = list(rewards) if rewards is not None else [None] * len(ids)
        if all(r is not None for r in batch):
            del self._pending[id(ids)]
            self._write(kwargs, batch)

    # -- the snapshot ---------------------------------------------------------------------

    def _write(self, kwargs: dict[str, Any], per_func: list[list[Any]]) -> None:
        if self.args is None:
            raise TRLRecorderError("the recorder's callback is not attached: pass "
                                   "callbacks=[recorder.callback] to the trainer")
        step = int(kwargs["trainer_state"].global_step)
        checkpoint = policy_checkpoint(Path(self.args.output_dir), CHECKPOINT_PATTERN, step,
                                       self.initial_policy_dir)
        records = self.records(step, kwargs["prompts"], kwargs["completions"],
                               kwargs["completion_ids"], per_func)
        summary = self.writer.write_step(step, records, checkpoint.path, checkpoint.version,
                                         sampling=sampling_of(self.args))
        log.info("step %d: recorded %d rollouts (policy %s)", step, summary.accepted,
                 checkpoint.path.name)
        self.written.append(summary)

    def records(self, step: int, prompts: Sequence[Any], completions: Sequence[Any],
                completion_ids: Sequence[Sequence[int]],
                per_func: list[list[Any]]) -> list[dict[str, Any]]:
        """The snapshot records of one generation batch (rows in TRL's order)."""
        eos = self.tokenizer.eos_token_id
        out = []
        for i, (prompt, completion, ids) in enumerate(
                zip(prompts, completions, completion_ids, strict=True)):
            ids = [int(t) for t in ids]
            record: dict[str, Any] = {
                "rollout_id": f"trl-step{step:06d}-{i:05d}",
                "trainer_step": step,
                "generated_by_policy_version": step,
                "prompt_token_ids": self._prompt_ids(prompt),
                "response_token_ids": ids,
                "reward": _weighted([f[i] for f in per_func], self.weights),
                "finish_reason": "stop" if ids and ids[-1] == eos else "length",
                "token_fidelity": "exact",
            }
            if isinstance(prompt, str):
                record["prompt"] = prompt
            else:
                record["messages"] = [*map(_message, prompt), *_completion_messages(completion)]
            out.append(record)
        return out

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):  # TRL: processing_class(text=prompts)
            return list(self.tokenizer(text=prompt)["input_ids"])
        encoded = self.tokenizer.apply_chat_template(
            list(prompt), add_generation_prompt=True, tokenize=True, return_dict=True,
            **self.chat_template_kwargs)
        return list(encoded["input_ids"])


class _Callback(TrainerCallback):
    """Sees the training arguments and refuses the set-ups the recorder would get wrong."""

    def __init__(self, recorder: TRLRecorder):
        self.recorder = recorder

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(args, "world_size", 1) > 1:
            raise TRLRecorderError(
                f"{args.world_size} processes: the recorder writes one snapshot per step "
                "from one process; run TRL on one process or record from rank 0 only")
        strategy = str(getattr(args, "eval_strategy", "no"))
        if strategy not in ("no", "IntervalStrategy.NO"):
            raise TRLRecorderError(
                f"eval_strategy={strategy!r}: evaluation batches reach the reward functions "
                "at the same global_step and would overwrite the step's snapshot; set "
                "eval_strategy='no' while recording")
        self.recorder.args = args


def sampling_of(args: Any) -> dict[str, Any]:
    """The sampler of a ``GRPOConfig``/``RLOOConfig`` in SGLang's names (TRL's ``top_k`` 0
    and ``min_p`` None mean off, as Aerie's)."""
    out: dict[str, Any] = {"temperature": float(args.temperature),
                           "top_p": float(getattr(args, "top_p", 1.0) or 1.0)}
    if getattr(args, "top_k", None):
        out["top_k"] = int(args.top_k)
    if getattr(args, "min_p", None):
        out["min_p"] = float(args.min_p)
    return out


def _weighted(rewards: list[Any], weights: list[float]) -> float | None:
    """TRL's reward: the weighted sum over the functions that scored the row (None = NaN,
    skipped); None when none did."""
    scored = [(r, w) for r, w in zip(rewards, weights, strict=True)
              if r is not None and not math.isnan(r)]
    return sum(float(r) * w for r, w in scored) if scored else None


def _message(m: Any) -> dict[str, str]:
    content = m["content"]
    if not isinstance(content, str):
        raise TRLRecorderError(f"message content {type(content).__name__}: the recorder "
                               "records text conversations only")
    return {"role": m["role"], "content": content}


def _completion_messages(completion: Any) -> list[dict[str, str]]:
    if isinstance(completion, str):
        return [{"role": "assistant", "content": completion}]
    messages = [_message(m) for m in completion]
    if [m["role"] for m in messages] != ["assistant"]:
        raise TRLRecorderError(
            f"a completion with roles {[m['role'] for m in messages]}: tool-calling "
            "rollouts need the mask of tool-result tokens, which TRL does not pass to reward "
            "functions; the recorder records single-turn completions only")
    return messages
