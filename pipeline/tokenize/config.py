"""How the tokenize stage builds samples (:class:`TokenizeConfig`).

Torch-free, so that Dagster run config can mirror it without loading torch with the
definitions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenizeConfig:
    """How samples are built; see the module docstring for the truncation window."""

    max_length: int = 2048
    keep_tail: int = 512  # response-end tokens always kept when cutting (capped at max_length)
    min_response_tokens: int = 1  # fewer masked tokens than this: the sample is dropped
    rows_per_file: int = 4096
    end_of_turn_tokens: tuple[str, ...] = ()  # empty: EOS + known turn closers in the vocab
    max_examples: int = 5  # example sample ids per problem kind in the manifest

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise ValueError(f"max_length {self.max_length} must be at least 2")
        if self.keep_tail < 1:
            raise ValueError(f"keep_tail {self.keep_tail} must be positive")
        if self.min_response_tokens < 1 or self.rows_per_file < 1 or self.max_examples < 0:
            raise ValueError("min_response_tokens and rows_per_file must be positive")
