"""The demo RL world: a small, deterministic stand-in for a user's RL trainer.

It trains a byte-level BPE tokenizer with a chat template, pretrains a tiny Llama policy on
column-by-column addition with many style choice points, then runs group-normalised
REINFORCE with a brevity-penalised reward, writing an HF checkpoint and exact-token rollout
records per step. The policy drifts for real (style choices flip) while the arithmetic
stays right, so a drafter trained on early steps measurably goes stale.

Entry point: :func:`pipeline.demo.world.generate_world` with a
:class:`pipeline.demo.config.DemoConfig`.
"""
