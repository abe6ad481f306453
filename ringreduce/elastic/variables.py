"""A ``State`` of framework variables kept as numpy copies, written once for every layer.

The framework layer says which variables make up the state (``variables()``, called at
every save, restore and sync, so that lazily created ones, such as a Keras optimizer's,
are included once they exist), how to read and assign one, and how to broadcast a list
of them from rank 0. ``save`` copies every value to a numpy array; ``restore`` assigns the
copies back; ``sync`` broadcasts rank 0's variables, then saves them as this rank's
commit, then syncs the plain values (``ObjectState``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from ..exceptions import InvalidInputError
from .state import ObjectState

__all__ = ["VariablesState"]


class VariablesState(ObjectState):
    """Variables plus plain values (the keywords), saved in memory at each ``commit()``.

    Subclasses implement ``variables``, ``broadcast_variables``, and may override
    ``read`` and ``assign``.

    Parameters
    ----------
    bcast_object, get_rank : callable, optional
        As for ``ObjectState``.
    **kwargs :
        The plain values (``epoch=0``...), attributes of the state.
    """

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any) -> None:
        self._saved_values: list[np.ndarray] = []
        super().__init__(bcast_object, get_rank, **kwargs)
        self._save_variables()

    # ------------------------------------------------------------ the layer's part
    def variables(self) -> list:
        """The variables of the state now, in an order every rank shares."""
        raise NotImplementedError

    def broadcast_variables(self, variables: list) -> None:
        """Overwrite ``variables`` with rank 0's values (collective)."""
        raise NotImplementedError

    def read(self, variable: Any) -> np.ndarray:
        """A numpy copy of ``variable``'s value."""
        return np.array(variable.numpy(), copy=True)

    def assign(self, variable: Any, value: np.ndarray) -> None:
        """Set ``variable`` to ``value``."""
        variable.assign(value)

    # ------------------------------------------------------------ State
    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        variables = self.variables()
        if len(variables) != len(self._saved_values):
            raise InvalidInputError(
                f"{type(self).__name__}.restore: the state has {len(variables)} variables "
                f"now but {len(self._saved_values)} at the last commit (variables were "
                "created since; build the model and optimizer before the first commit)")
        for variable, value in zip(variables, self._saved_values):
            self.assign(variable, value)
        super().restore()

    def sync(self) -> None:
        self.broadcast_variables(self.variables())
        self._save_variables()
        super().sync()

    def _save_variables(self) -> None:
        self._saved_values = [self.read(v) for v in self.variables()]
