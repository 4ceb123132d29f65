"""kvspec.spec: the executable specification.

State (``state``), the logic helpers shared by concrete and symbolic
evaluation (``logic``), the named invariants (``invariants``), the actions as
relations between a state and the next (``actions``) and the data oracle that
models the worker's KV content (``oracle``).
"""
