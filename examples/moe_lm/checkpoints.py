"""Orbax checkpoints of model state (selection biases included), optimizer state and step."""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp
from flax import nnx


class Checkpoints:
    """Orbax checkpoints of `{"model": state incl. selection biases, "optimizer": state}` by step."""

    def __init__(self, directory: Path, *, keep: int = 2):
        self.manager = ocp.CheckpointManager(
            directory.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, model, optimizer) -> None:
        state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        self.manager.save(step, args=ocp.args.StandardSave(state))

    def restore(self, model, optimizer) -> int:
        """Load the latest checkpoint into `model` and `optimizer` (same shapes and shardings)."""
        step = self.latest_step()
        target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(target))
        nnx.update(model, restored["model"])
        nnx.update(optimizer, restored["optimizer"])
        return step

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc_info) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
