"""Format validation of a drafter directory before it may be registered or promoted.

SGLang silently ignores unknown tensor names and loads whatever shapes it is given, so a
malformed drafter would serve garbage without an error. :func:`drafter_format_errors`
checks a directory the way SGLang's ``LlamaForCausalLMEagle3`` will read it.

Invariants:

- Never raises for a bad drafter: every problem found is returned as one message (empty
  tuple = valid), so the gate can explain the refusal.
- Expected names, shapes and dtypes come from the drafter model itself (built on the
  ``meta`` device from the directory's config.json), not from a second copy of the rules.
- Reads tensors one at a time with safetensors (no pickle); only ``d2t``/``t2d`` and
  float-weight finiteness need their values.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from pipeline.eagle3.export import CONFIG_NAME, WEIGHTS_NAME, read_drafter_config
from pipeline.eagle3.model import Eagle3Drafter, check_vocab_mapping, exported_names

_INDEX_DTYPES = {"d2t": torch.int64, "t2d": torch.bool}


def drafter_format_errors(directory: str | Path) -> tuple[str, ...]:
    """Every reason ``directory`` is not a loadable EAGLE-3 drafter; empty when it is."""
    directory = Path(directory)
    if not (directory / CONFIG_NAME).is_file():
        return (f"{CONFIG_NAME} is missing",)
    if not (directory / WEIGHTS_NAME).is_file():
        return (f"{WEIGHTS_NAME} is missing",)
    try:
        config = read_drafter_config(directory)
    except (ValueError, KeyError, TypeError) as e:
        return (f"{CONFIG_NAME} is not a valid EAGLE-3 drafter config: {e}",)
    with torch.device("meta"):
        reference = Eagle3Drafter(config, torch.empty(config.vocab_size, config.hidden_size))
    expected = {n: t for n, t in reference.exported_state_dict().items()}
    names_wanted = set(exported_names(config))

    errors: list[str] = []
    try:
        with safe_open(str(directory / WEIGHTS_NAME), framework="pt") as f:
            names = set(f.keys())
            missing, extra = names_wanted - names, names - names_wanted
            if missing:
                errors.append(f"missing tensors {sorted(missing)}")
            if extra:
                errors.append(f"unexpected tensors {sorted(extra)} (SGLang ignores them)")
            float_dtypes = set()
            index = {}
            for name in sorted(names & names_wanted):
                x = f.get_tensor(name)
                want = expected[name]
                if tuple(x.shape) != tuple(want.shape):
                    errors.append(f"{name}: shape {tuple(x.shape)}, config implies "
                                  f"{tuple(want.shape)}")
                if name in _INDEX_DTYPES:
                    if x.dtype != _INDEX_DTYPES[name]:
                        errors.append(f"{name}: dtype {x.dtype}, expected "
                                      f"{_INDEX_DTYPES[name]}")
                    index[name] = x
                    continue
                float_dtypes.add(x.dtype)
                if not x.is_floating_point():
                    errors.append(f"{name}: dtype {x.dtype} is not a float type")
                elif not bool(torch.isfinite(x).all()):
                    errors.append(f"{name}: contains NaN or infinite values")
            if len(float_dtypes) > 1:
                errors.append(f"weights mix dtypes {sorted(str(d) for d in float_dtypes)}")
    except Exception as e:  # noqa: BLE001 - a corrupt file is a format error, not a crash
        return (*errors, f"{WEIGHTS_NAME} cannot be read: {type(e).__name__}: {e}")
    if "d2t" in index and "t2d" in index:
        try:
            check_vocab_mapping(index["d2t"], index["t2d"])
        except ValueError as e:
            errors.append(f"vocab mapping: {e}")
    return tuple(errors)
