"""The ``sglang-hotswap`` mode: replace draft weights inside running SGLang (≥ 0.5.21) servers.

SGLang's sequence, per server: ``/pause_generation`` → ``/begin_weight_update {"selector":
"draft"}`` → ``/update_weights_from_tensor`` → ``/end_weight_update`` → ``/flush_cache`` →
``/continue_generation``. It only works for a drafter with the same shapes, the same aux
layers and the same ``d2t`` as the one being served; anything else needs a restart.

What Aerie does NOT do: ``/update_weights_from_tensor`` takes ``serialized_named_tensors``
(``managers/io_struct.py``, one entry per TP rank) that the workers decode with
``MultiprocessingSerializer.deserialize(serialized_named_tensors[tp_rank])``, i.e. a pickle
(``ForkingPickler``; newer releases use an allow-listed unpickler) of tensors or CUDA-IPC
handles made by a process on the same host (sgl-project/sglang, ``srt/utils``
``MultiprocessingSerializer`` and the TP/EAGLE workers' ``update_weights_from_tensor``).
Aerie never writes pickles, so it ships no payload encoder: :class:`SglangHotswap` refuses
before touching any server unless the operator injects an ``encoder`` they trust. (The
pickle-free alternative, ``/init_weights_update_group`` + ``/update_weights_from_distributed``,
broadcasts over NCCL from a GPU process that joins the server's group; not implemented.)

Invariants:

- Refusals (shape/aux/d2t mismatch, no encoder, no drafter) happen in ``check``/before the
  first request; a refused swap sends nothing.
- Once ``/pause_generation`` succeeded, ``/end_weight_update`` (if a session was opened) and
  ``/continue_generation`` are sent even when a later step fails, so a failed swap never
  leaves a server paused; the failure is then raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import requests
import torch
from safetensors import safe_open

from pipeline.eagle3.config import shapes_match
from pipeline.eagle3.export import WEIGHTS_NAME, read_drafter_config
from pipeline.release.backend import ServingError, ServingRefused
from pipeline.serving_now import ServingTarget

log = logging.getLogger(__name__)

# drafter directory -> serialized_named_tensors (one entry per TP rank), in SGLang's format
TensorPayloadEncoder = Callable[[Path], list[str]]

NO_ENCODER = ("sglang-hotswap needs a payload for /update_weights_from_tensor in SGLang's "
              "pickle-based MultiprocessingSerializer format, which Aerie does not produce; "
              "use serving mode 'sglang-restart' or 'manifest' (or inject an encoder you "
              "trust)")


def hotswap_refusals(current_dir: Path, new_dir: Path, *, same_d2t: bool = True
                     ) -> tuple[str, ...]:
    """Why ``new_dir`` cannot be hot-swapped in place of ``current_dir`` (empty: it can).
    ``same_d2t``: the engine keeps the draft vocabulary map (SGLang) rather than reloading
    it with the weights (vLLM)."""
    try:
        old, new = read_drafter_config(current_dir), read_drafter_config(new_dir)
    except (OSError, ValueError, KeyError) as e:
        return (f"cannot read drafter configs: {e}",)
    reasons = []
    if not shapes_match(old, new):
        reasons.append("drafter shapes differ from the serving drafter's")
    if (old.rope_theta, old.rope_scaling) != (new.rope_theta, new.rope_scaling):
        # weights are swapped, config.json is not: the server would keep the old rotation
        reasons.append(f"RoPE (theta {new.rope_theta}, scaling {new.rope_scaling}) differs "
                       f"from the serving drafter's (theta {old.rope_theta}, scaling "
                       f"{old.rope_scaling})")
    if old.aux_layer_ids != new.aux_layer_ids:
        reasons.append(f"aux layer ids {list(new.aux_layer_ids)} differ from the serving "
                       f"{list(old.aux_layer_ids)}")
    if same_d2t and not reasons and not torch.equal(_d2t(current_dir), _d2t(new_dir)):
        reasons.append("d2t (draft vocabulary) differs from the serving drafter's")
    return tuple(reasons)


def _d2t(directory: Path) -> torch.Tensor:
    with safe_open(str(directory / WEIGHTS_NAME), framework="pt") as f:
        return f.get_tensor("d2t")


class HotswapClient:
    """The weight-update endpoints of one SGLang server."""

    def __init__(self, base_url: str, *, timeout_s: float = 120.0,
                 session: requests.Session | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = session or requests.Session()

    def post(self, path: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        url = f"{self.base_url}{path}"
        try:
            r = self.session.post(url, json=payload or {}, timeout=self.timeout_s)
        except requests.RequestException as e:
            raise ServingError(f"{url}: {type(e).__name__}: {e}") from e
        try:
            body = r.json() if r.content else {}
        except ValueError:
            body = {"text": r.text[:500]}
        if r.status_code >= 400 or (isinstance(body, dict) and body.get("success") is False):
            raise ServingError(f"{url}: HTTP {r.status_code}: "
                               f"{body.get('message', body) if isinstance(body, dict) else body}")
        return body if isinstance(body, dict) else {"value": body}

    def swap_draft(self, serialized_named_tensors: list[str], *,
                   load_format: str | None = None) -> None:
        """The full pause → update → continue sequence for the draft model."""
        self.post("/pause_generation")
        opened = False
        try:
            self.post("/begin_weight_update", {"selector": "draft"})
            opened = True
            self.post("/update_weights_from_tensor", {
                "serialized_named_tensors": serialized_named_tensors,
                "load_format": load_format, "flush_cache": False, "selector": "draft"})
            opened = False
            self.post("/end_weight_update", {})
            self.post("/flush_cache")
        finally:
            try:
                if opened:
                    self.post("/end_weight_update", {})
            finally:
                self.post("/continue_generation")


class SglangHotswap:
    """An :class:`~pipeline.release.backend.Actuator` that hot-swaps draft weights."""

    mode = "sglang-hotswap"
    compares_with_current = True

    def __init__(self, server_urls: Sequence[str], *, timeout_s: float = 120.0,
                 encoder: TensorPayloadEncoder | None = None,
                 session: requests.Session | None = None):
        if not server_urls:
            raise ValueError("sglang-hotswap needs at least one server URL")
        self.clients = [HotswapClient(u, timeout_s=timeout_s, session=session)
                        for u in server_urls]
        self.encoder = encoder

    def check(self, new_dir: Path, current_dir: Path | None) -> None:
        if current_dir is None:
            raise ServingRefused("sglang-hotswap needs a drafter already being served; the "
                                 "first drafter must be deployed with a restart")
        reasons = hotswap_refusals(current_dir, new_dir)
        if reasons:
            raise ServingRefused("hot swap refused: " + "; ".join(reasons)
                                 + " (use serving mode 'sglang-restart')")
        if self.encoder is None:
            raise ServingRefused(NO_ENCODER)

    def activate(self, new_dir: Path | None, target: ServingTarget | None) -> dict[str, str]:
        if new_dir is None:
            raise ServingRefused("sglang-hotswap cannot remove the drafter of a running server")
        if self.encoder is None:
            raise ServingRefused(NO_ENCODER)
        payload = self.encoder(new_dir)
        done = []
        for client in self.clients:
            try:
                client.swap_draft(payload)
            except ServingError as e:
                raise ServingError(f"hot swap failed on {client.base_url} ({e}); already "
                                   f"swapped: {done or 'none'}") from e
            done.append(client.base_url)
        return {"servers": ",".join(done)}
