"""The HiSparse resident group's reservation, measured on vLLM's own manager.

Run with vLLM 0.33.0's source first on the path (no model, no GPU; the
manager and block pool are pure Python):

    PYTHONPATH=<0.33.0 source root> VLLM_TARGET_DEVICE=cpu python hisparse_reservation.py

A HiSparse resident group keeps at most ``max_admission_blocks_per_request``
pages of a request on the GPU (block size 64, ``max_in_flight_tokens`` 256: 4
pages); the pages of an imported load or a host-prefix hit are null entries
of its block table. The capped count (the reservation of a request whose load
is in flight, ``Scheduler._request_remaining_blocks``) subtracts the table's
length, so it counts 0 where the next step takes 1 or 4 real pages.
"""
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.single_type_kv_cache_manager import (
    HiSparseResidentManager, get_manager_for_kv_cache_spec, register_all_kvcache_specs)
from vllm.v1.kv_cache_interface import HiSparseResidentSpec

BLOCK = 64


class _Coordinator:
    """The two calls the manager makes on its coordinator here."""

    def free(self, request_id):
        pass

    def commit_computed_blocks(self, request_id, n):
        pass


def make_manager():
    try:
        register_all_kvcache_specs(None)
    except Exception as exc:  # noqa: BLE001 - registered already, or not needed
        print("register_all_kvcache_specs:", exc)
    pool = BlockPool(num_gpu_blocks=40, enable_caching=False, hash_block_size=BLOCK)
    manager = get_manager_for_kv_cache_spec(
        HiSparseResidentSpec(block_size=BLOCK, page_size=1024), max_in_flight_tokens=256,
        max_model_len=65536, block_pool=pool, enable_caching=False, kv_cache_group_id=0,
        scheduler_block_size=BLOCK)
    assert isinstance(manager, HiSparseResidentManager)
    manager.coordinator = _Coordinator()
    return manager


def real_pages(manager, request_id):
    return sum(not b.is_null for b in manager.req_to_blocks[request_id])


def loaded_then_next_step(manager, prompt, loaded=512, budget=256):
    """An async load of ``loaded`` tokens lands; the reservation while it was
    in flight, and what the request's next step takes."""
    rid = f"load-{prompt}"
    manager.allocate_external_computed_blocks(rid, 0, loaded)
    manager.allocate_new_blocks(rid, loaded, loaded)
    manager.num_cached_block[rid] = 0
    reserved = manager.get_num_blocks_to_allocate(rid, prompt, [], loaded, loaded, prompt,
                                                  apply_admission_cap=True)
    entries, real = len(manager.req_to_blocks[rid]), real_pages(manager, rid)
    upto = min(prompt, loaded + budget)
    taken = len(manager.allocate_new_blocks(rid, upto, upto))
    print(f"prompt {prompt}, load of {loaded} tokens: table of {entries} entries, "
          f"{real} real, reserved {reserved}, the next step took {taken} pages")
    manager.free(rid)
    return reserved, taken


def host_hit_then_chunk(manager, prompt=1024, hit=512, budget=256):
    """A host-prefix hit, one chunk, then the capped count of the rest."""
    rid = "host-hit"
    first = manager.get_num_blocks_to_allocate(rid, prompt, [], hit, hit, prompt,
                                               apply_admission_cap=True)
    manager.add_local_computed_blocks(rid, [], hit, 0)
    taken = len(manager.allocate_new_blocks(rid, hit + budget, hit + budget))
    rest = manager.get_num_blocks_to_allocate(rid, prompt, [], hit + budget, hit + budget,
                                              prompt, apply_admission_cap=True)
    print(f"prompt {prompt}, host hit of {hit}: first admission counted {first}, the chunk "
          f"took {taken}; then {real_pages(manager, rid)} pages held, {rest} counted still")
    return first, taken, rest


if __name__ == "__main__":
    m = make_manager()
    print("cap:", m.max_admission_blocks_per_request, "pages")
    assert loaded_then_next_step(m, 513) == (0, 1)
    assert loaded_then_next_step(m, 1024) == (0, 4)
    assert host_hit_then_chunk(m) == (0, 4, 0)
