"""Every claim, registered in one order: state and data invariants, action
relations, conformance to the Z3 model, liveness, the connector contract. Import this module to get
the whole catalogue in ``kvspec.spec.registry.REGISTRY``."""
from __future__ import annotations

import kvspec.spec.invariants  # noqa: F401
import kvspec.spec.actions  # noqa: F401
import kvspec.spec.conformance  # noqa: F401
import kvspec.spec.liveness  # noqa: F401
import kvspec.spec.contract  # noqa: F401
from kvspec.spec.registry import REGISTRY

__all__ = ["REGISTRY"]
