"""The `tensorhub` weight-transfer backend: vLLM creates it in each worker process.

It keeps a checkpoint-layout copy of the weights it holds (`CheckpointCopy`) that pulls
new versions while the engine serves, and serves them to other engines. Applying a version
is vLLM's layerwise reload (the path that works on CPU, where linear weights are repacked
after loading) fed from that copy. Everything that can fail — holding the wrong version,
a pull in progress, tensors the model does not load — is checked before the model is
touched, so a refused update leaves the engine on its previous weights; a load that still
fails half-way is undone by loading the previous version again (`engines/restore.py`).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from tensorhub import TensorHubError, settings
from tensorhub.engines import (
    BackgroundCheck,
    CheckAnswer,
    CheckpointCopy,
    InstallFailed,
    LoadOutcome,
    RankVote,
    ShareCheck,
    SharedCopyReader,
    TornLoad,
    apply_shared,
    checkpoint_tensors,
    from_checkpoint,
    node_of,
    node_share,
    restore_after,
    sparse_install,
    stage_share,
    tied_optional,
)
from tensorhub.quant import recipe_of, split_quantized
from tensorhub_plugins.vllm import fp8_install
from tensorhub_plugins.vllm.commands import (
    CanInstall,
    CanInstallAnswer,
    Check,
    Command,
    Init,
    Installed,
    InstalledAnswer,
    Release,
    parse,
)
from tensorhub_plugins.vllm.copies import copy_holders, engine_nodes, one_copy_per_engine
from tensorhub_plugins.vllm.experts import (
    experts_split_as_attention,
    keep_cpu_experts_packed,
    node_experts,
)

log = logging.getLogger("tensorhub.vllm")


class TensorHubInitInfo(WeightTransferInitInfo):
    """(vLLM's type for init info; ours is a command, `commands.parse`.)"""


@dataclass
class TensorHubUpdateInfo(WeightTransferUpdateInfo):
    """`fetch`: pull `version` from peers first if the copy holds another (restoring the
    version served before when the weights were left torn)."""

    version: int = 0
    fetch: bool = False


class TensorHubEngine(WeightTransferEngine[TensorHubInitInfo, TensorHubUpdateInfo]):
    init_info_cls = TensorHubInitInfo  # (unused: `parse_init_info` makes a command)
    update_info_cls = TensorHubUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.checkpoint: CheckpointCopy | None = None
        # The ranks of a node (of one pipeline stage) share their lowest rank's copy
        # (`engines/shared_copy.py`): only that rank holds one.
        self.one_copy = one_copy_per_engine(self.parallel_config)
        self._shared: SharedCopyReader | None = None
        self._share_check = ShareCheck()  # its first load from a node's share, scanned
        self._whole_versions = False  # a load from a share failed: no share from then on
        self._votes: RankVote | None = None
        self._node_votes: RankVote | None = None  # among this node's ranks (several nodes)
        self._vote_timeout = 120.0 + settings.VOTE_MARGIN_S
        self.applied: int | None = None  # the version this rank's model holds (None: disk)
        self._checks = BackgroundCheck()
        # An fp8 engine whose quantization runs before the pause (`fp8_install`): None until
        # its first load shows vLLM's quantization is ours, then True or False.
        self._fp8_direct: bool | None = False
        self._quantized: tuple[int, dict] | None = None  # (version, its fp8 layers)
        # The trainer's quantized layout this engine follows (`<model>@<recipe>`), and why
        # it cannot install it (None: it can).
        self._layout_recipe: str | None = None
        self._cannot_layout: str | None = None
        self._layout_checks: dict[str, str | None] = {}  # recipe -> `_why_not_layout`
        # A sparse step written word by word where the live weights keep the checkpoint's
        # layout (`sparse_install`; a GPU's, not vLLM's CPU GEMMs, which repack them).
        self._live = sparse_install.LiveBlocks()
        self._plan: sparse_install.Plan | None = None
        self._installed_as: str | None = None  # how `applied` was installed (`Installed`)
        self._failed: LoadOutcome | None = None  # what became of the last update, if it failed
        self._writes = 0  # loads into the live weights: a plan is valid for one count
        if self.device.type == "cpu":
            keep_cpu_experts_packed(self.model)

    def _worker_name(self, base: str) -> str:
        world = self.parallel_config.world_size
        if world == 1:
            return base
        return f"{base}-rank{self._rank()}"

    def _group(self):
        """The process group of this engine's ranks (None: a single rank). With pipeline
        parallelism and data parallelism both, vLLM's world group spans several engines:
        then each rank decides alone (logged at start)."""
        pc = self.parallel_config
        if pc.world_size == 1:
            return None
        from vllm.distributed import get_tp_group, get_world_group

        if pc.pipeline_parallel_size == 1:
            return get_tp_group()
        return get_world_group() if pc.data_parallel_size == 1 else None

    def _share(self):
        """What this rank's copy pulls of a version in tiles: the tiles of the TP ranks
        that load from it (its node's, with one copy per node; else its own); of a version
        in layer blocks, a pipeline stage's parts (`stages.stage_share`, by the names of the
        parameters this rank's stage runs). Under expert parallelism, also the tiles of the
        experts those ranks run (`experts.node_experts`). None: every part (one rank, or
        experts placed otherwise than vLLM's rule says)."""
        pc = self.parallel_config
        if pc.world_size == 1 or self._whole_versions:
            return None
        if pc.pipeline_parallel_size != 1:
            return stage_share(name for name, _ in self.model.named_parameters())
        group = self._group()
        tp = len(group.ranks)
        ranks = node_of(group.rank_in_group, tp, engine_nodes(pc)) if self.one_copy \
            else [group.rank_in_group]
        try:
            kv_heads = self.vllm_config.model_config.get_total_num_kv_heads()
        except Exception:  # (a model whose config does not say: K/V as if one per rank)
            kv_heads = None
        if not getattr(pc, "enable_expert_parallel", False):
            if not experts_split_as_attention(self.model, tp):
                log.info("TensorHub: this engine's MoE layers split their experts over more "
                         "ranks than its attention (data parallelism): its copy pulls every "
                         "part of a version in tiles")
                return None
            return node_share(ranks, tp, kv_heads)
        experts = node_experts(self.model, ranks, group.rank_in_group, tp)
        if experts is None:
            log.info("TensorHub: this engine's experts are not placed by vLLM's rule for "
                     "each rank (or move): its copy pulls every part of a version in tiles")
            return None
        log.info("TensorHub: this copy pulls its ranks' tiles and those of their %d of %d "
                 "experts", len(experts.ids), experts.total)
        return node_share(ranks, tp, kv_heads, experts)

    def _rank_votes(self) -> RankVote:
        if self._votes is None:
            import torch.distributed as dist

            self._votes = RankVote(self._group().ranks, dist.get_rank(), self._vote_timeout)
        return self._votes

    def _node_broadcast(self) -> RankVote:
        """The broadcast among the ranks that share this rank's copy (its node's, of its
        pipeline stage), from the rank that holds it: the engine's own votes where they
        are all its ranks (one round counter per group of ranks)."""
        if self._node_votes is None:
            import torch.distributed as dist

            group = self._group()
            mine = node_of(group.rank_in_group, len(group.ranks),
                           engine_nodes(self.parallel_config),
                           stages=self.parallel_config.pipeline_parallel_size)
            if len(mine) == len(group.ranks):
                self._node_votes = self._rank_votes()
            else:
                self._node_votes = RankVote([group.ranks[i] for i in mine], dist.get_rank(),
                                            self._vote_timeout)
        return self._node_votes

    def _agree(self, ok: bool) -> bool:
        """Whether every rank of this engine is ready: one version per engine, on all
        ranks or on none (a rank that does not answer in time counts as a no)."""
        return ok if self._group() is None else self._rank_votes()(ok)

    def parse_init_info(self, init_dict: dict) -> Command:
        return parse(init_dict)

    def init_transfer_engine(self, init_info: Command) -> None:
        if isinstance(init_info, Init):
            self._vote_timeout = init_info.pull_timeout + settings.VOTE_MARGIN_S
            if self.checkpoint is not None:
                self.checkpoint.close()
            if self.one_copy and self._group().rank_in_group not in copy_holders(
                    self.parallel_config):
                self._shared = SharedCopyReader()
                log.info("TensorHub: this rank loads from its node's checkpoint copy")
                return
            self.checkpoint = CheckpointCopy(
                init_info.coordinator, init_info.model, self._worker_name(init_info.name),
                transport=init_info.transport, follow=init_info.follow,
                pull_timeout=init_info.pull_timeout, share=self._share())
            self._layout_recipe = recipe_of(init_info.model)
            if self._layout_recipe is not None:
                self._cannot_layout = self._why_not_layout(self._layout_recipe)
                if self._cannot_layout is not None:
                    log.error("TensorHub: %s is a quantized layout this engine cannot "
                              "install (%s): it refuses every version; name the bf16 model "
                              "in TENSORHUB_MODEL", init_info.model, self._cannot_layout)
            elif self.parallel_config.world_size == 1 and self.device.type == "cpu" \
                    and fp8_install.only_per_channel(self.model):
                self._fp8_direct = None  # (shown, or not, by the first load)
            self.checkpoint.loadable = self._loadable()
            log.info("TensorHub checkpoint copy %s ready (follow=%s)", self.checkpoint.name,
                     init_info.follow)
        elif isinstance(init_info, Release):
            if self.checkpoint is not None:
                self.checkpoint.release(init_info.version)
        elif isinstance(init_info, Check | CanInstall | Installed):  # (logged: `_answers`)
            log.error("TensorHub: a %s came through init_weight_transfer_engine; questions "
                      "are asked through collective_rpc('weight_transfer_engine')",
                      type(init_info).__name__)
        elif self._shared is None:  # Prefetch (logged, not raised: see `_answers`)
            if self.checkpoint is None:
                log.error("TensorHub: cannot pull v%s: this rank's copy was not initialised",
                          init_info.version)
            else:
                self.checkpoint.prefetch(init_info.version or "latest")

    def _answers(self) -> bool:
        """Whether this rank raises what the engine's ranks found wrong: vLLM's executor
        reads the ranks' answers in rank order and stops at the first failure, leaving the
        later ranks' answers queued to answer its next call, so only the last rank may."""
        group = self._group()
        return group is None or group.rank_in_group == group.world_size - 1

    def __call__(self, question: dict) -> dict:
        """The answering call: vLLM's `collective_rpc` runs a worker's attribute by name
        and returns every rank's result, and this engine is the worker's
        `weight_transfer_engine`, so the front end asks it `Check` questions this way (the
        commands through `init_weight_transfer_engine` return nothing). The check runs in
        a thread of its own: answered at once, the engine keeps stepping meanwhile. Never
        raises (see `_answers`): what goes wrong is a refusal."""
        try:
            ask = parse(question)
            if isinstance(ask, CanInstall):
                try:
                    cannot = self._why_not_layout(ask.recipe)
                except Exception as exc:
                    cannot = f"checking it failed ({exc})"
                return CanInstallAnswer(cannot=cannot).model_dump()
            if isinstance(ask, Installed):
                return InstalledAnswer(version=self.applied, install=self._installed_as,
                                       failed=self._failed).model_dump()
            if not isinstance(ask, Check):
                return CheckAnswer.refused(f"TensorHub engines answer checks only, not "
                                           f"{ask.op!r}").model_dump()
            checkpoint = self.checkpoint
            if checkpoint is None:
                if self._shared is not None:  # it loads from its node's copy: nothing here
                    return CheckAnswer(state="ready").model_dump()
                return CheckAnswer.refused("TensorHub engine not initialised on this rank "
                                           "(see its log)").model_dump()
            return self._checks.answer(ask.asker, ask.attempt, ask.version,
                                       lambda: self._check(checkpoint, ask.version)
                                       ).model_dump()
        except Exception as exc:
            return CheckAnswer.refused(f"checking failed: {exc}").model_dump()

    def _check(self, checkpoint: CheckpointCopy, version: int) -> int | None:
        """The check before the pause (a thread of its own); an fp8 engine that quantizes
        before the pause quantizes the verified copy here too (if that fails, vLLM's reload
        quantizes it inside the pause); otherwise each version is compared with the live
        weights for a sparse install (`_plan_sparse`: the elements it will write), whether
        it came as patches or whole (on one host no patch pays, so none is built)."""
        self._quantized = None
        if self._layout_recipe is not None:
            return self._check_layout(checkpoint, version)
        if not self._fp8_direct and checkpoint.version == version and not self.one_copy \
                and self._live.error is None:
            return self._plan_sparse(checkpoint, version)
        if not self._fp8_direct or checkpoint.version != version:
            checkpoint.check(version)  # (a copy that holds another version: the install says)
            return None
        started = time.perf_counter()

        def quantize(named) -> dict | None:
            try:
                return fp8_install.quantize(self.model, named)
            except Exception as exc:
                log.warning("TensorHub: quantizing v%d before the pause failed (%s); vLLM's "
                            "reload quantizes it", version, exc)
                return None

        quantized = checkpoint.prepare(version, quantize)
        if quantized is not None:
            self._quantized = (version, quantized)
            log.info("TensorHub: v%d verified and quantized before the pause in %.0f ms",
                     version, (time.perf_counter() - started) * 1e3)
        return None

    def _check_layout(self, checkpoint: CheckpointCopy, version: int) -> int | None:
        """The check of a version the trainer quantized (`<model>@<recipe>`): verify it,
        stack each fused layer's fp8 weights, and find the bytes that differ from the live
        ones (`fp8_install.plan_sparse`), all before the pause. Returns the elements a
        sparse install will write (None: whole)."""
        self._plan = None
        if self._cannot_layout is not None:
            raise InstallFailed.of("unloadable", version, (
                f"v{version} is in the quantized layout {checkpoint.model}, which this engine "
                f"cannot install ({self._cannot_layout}); name the bf16 model in "
                f"TENSORHUB_MODEL"))
        if checkpoint.version != version:  # (a repair: the install pulls it, then stacks)
            checkpoint.check(version)
            return None
        started, key = time.perf_counter(), self._live_key()

        def then(named) -> tuple[dict, sparse_install.Plan | None]:
            try:
                layers = fp8_install.from_layout(self.model, named)[0]
            except KeyError as exc:
                raise InstallFailed.of("unloadable", version, (
                    f"v{version} does not fill this engine's fp8 layers: {exc.args[0]}")
                    ) from None
            try:
                plan = fp8_install.plan_sparse(self.model, layers, version, key)
            except Exception as exc:  # (installed whole: never refused for this)
                log.warning("TensorHub: planning a sparse install of v%d failed (%s); it is "
                            "installed whole", version, exc)
                plan = None
            return layers, plan if self._live_key() == key else None

        try:
            layers, plan = checkpoint.prepare(version, then, busy_after=1.0)
        except TensorHubError as exc:
            if exc.code not in ("unknown_version", "busy"):
                raise
            return None  # (the copy moved on or is pulling: the install checks and stacks)
        self._quantized, self._plan = (version, layers), plan
        log.info("TensorHub: v%d verified and stacked before the pause in %.0f ms (%s)",
                 version, (time.perf_counter() - started) * 1e3,
                 f"sparse: {plan.changed} of {plan.total} fp8 bytes differ" if plan else "whole")
        return plan.changed if plan is not None else None

    def _install_layout(self, version: int, named, quantized: tuple | None,
                        plan: sparse_install.Plan | None) -> None:
        """Write a version the trainer quantized as it is: the fp8 bytes that differ where
        the check planned them for these live weights, else every fp8 weight and scale;
        then the other tensors (their own loaders), reloading only what cannot be placed."""
        if quantized is not None and quantized[0] == version \
                and self.checkpoint.prepared(version):
            layers, named = quantized[1], split_quantized(named)[1]
        else:  # (the check did not get to it: stacked here)
            layers, named, plan = *fp8_install.from_layout(self.model, named), None
        sparse = plan is not None and plan.version == version and plan.key == self._live_key()
        started = time.perf_counter()
        with self._writing():
            if sparse:
                sparse_install.install(plan)
            rest = fp8_install.write(self.model, layers, named, fp8_written=sparse)
        if sparse:
            self._installed_as = "sparse"
            log.info("TensorHub: v%d installed sparse: %d of %d fp8 bytes written in %.1f ms",
                     version, plan.changed, plan.total, (time.perf_counter() - started) * 1e3)
        if rest:
            self._load(rest)

    def _live_key(self) -> tuple:
        """What the live weights hold: a sparse plan is valid only for these bytes."""
        return (self.applied, self._writes)

    def _plan_sparse(self, checkpoint: CheckpointCopy, version: int) -> int | None:
        """Verify the copy and find the words of `version` that differ from the live
        weights (`sparse_install.plan`), while the engine generates; the install then
        writes only those. None: it installs whole (too much changed, or this model's
        live weights do not keep the checkpoint's layout: learnt once)."""
        started, key = time.perf_counter(), self._live_key()
        self._plan = None

        def then(named) -> sparse_install.Plan | None:
            share = checkpoint.replica.share_layout
            if self._live_key() != key or share not in (None, *self._share_check.passed) \
                    or not self._live.learn(self.model, named, _default_loader):
                return None  # (a first load from a share: whole, and checked)
            plan = self._live.plan(self.model, named, version, key)
            return plan if self._live_key() == key else None

        try:
            plan = checkpoint.prepare(version, then, busy_after=1.0)
        except TensorHubError as exc:
            if exc.code not in ("unknown_version", "busy"):
                raise
            return None  # (the copy moved on or is pulling: the install checks and says)
        if plan is None:
            return None
        self._plan = plan
        log.info("TensorHub: v%d verified and planned sparse before the pause in %.0f ms: "
                 "%d of %d elements differ", version, (time.perf_counter() - started) * 1e3,
                 plan.changed, plan.total)
        return plan.changed

    def _loadable(self):
        """What this engine's model loads: the checkpoint it started from, in the trainer's
        quantized layout where it follows one (None where it started with no weights: the
        first version it applies then tells)."""
        loadable = self._checkpoint_loads()
        if loadable is None or self._layout_recipe is None:
            return loadable
        return loadable.quantized(self._layout_recipe)

    def _checkpoint_loads(self):
        """What the checkpoint the engine started from holds (None: no weights, `dummy`)."""
        if self.vllm_config.load_config.load_format == "dummy":
            return None
        model_config = self.vllm_config.model_config
        return from_checkpoint(model_config.model, tied_optional(model_config.hf_config))

    def _why_not_layout(self, recipe: str) -> str | None:
        """Why this rank cannot install versions of the trainer's layout quantized by
        `recipe` (None: it can): its own quantization must be that recipe, on one CPU rank
        (where `tensorhub.quant`'s reference is pinned to vLLM's), of bf16 weights, over
        exactly the layers the trainer quantizes, and, while its weights are still its own
        load of its checkpoint, byte for byte the reference's (checked once)."""
        if recipe not in self._layout_checks:
            self._layout_checks[recipe] = self._layout_problem(recipe)
        return self._layout_checks[recipe]

    def _layout_problem(self, recipe: str) -> str | None:
        model_config = self.vllm_config.model_config
        if model_config.quantization != recipe:
            return f"the engine runs --quantization {model_config.quantization}, not {recipe}"
        if self.parallel_config.world_size != 1:
            return "it is written into one rank's weights only (TP=1)"
        if self.device.type != "cpu":
            return "its bytes are pinned to vLLM's own quantization on CPU only"
        if model_config.dtype != torch.bfloat16:
            return f"the trainer quantizes bf16 weights; this engine runs {model_config.dtype}"
        if not fp8_install.only_per_channel(self.model):
            return "not every quantized layer is vLLM's per-channel online method"
        loadable = self._checkpoint_loads()
        if loadable is None:
            return None  # (no checkpoint to compare with: each version's check says)
        gap = fp8_install.layout_gaps(self.model, loadable.specs)
        if gap is not None or self.applied is not None:
            return gap
        started = time.perf_counter()
        try:
            same = fp8_install.matches(self.model, fp8_install.quantize(
                self.model, checkpoint_tensors(model_config.model)))
        except Exception as exc:
            return f"comparing its quantization with the reference failed ({exc})"
        log.info("TensorHub: vLLM's quantization of the checkpoint %s the reference's "
                 "(compared in %.0f ms)", "gave the same bytes as" if same else "differs from",
                 (time.perf_counter() - started) * 1e3)
        return None if same else "vLLM's own quantization of its checkpoint differs from " \
            "the reference the trainer quantizes with"

    def start_weight_update(self) -> None:
        """Nothing to prepare: the whole swap happens in `receive_weights`, after checks."""

    def update_weights(self, update_info: dict) -> None:
        self._failed = None  # (an update refused before `receive_weights` says nothing)
        # The base class synchronises an accelerator, which raises on CPU.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: TensorHubUpdateInfo) -> None:
        started = time.perf_counter()
        try:
            self._apply(update_info)
        except Exception as exc:
            if isinstance(exc, InstallFailed):
                self._failed = exc.outcome  # (the front end asks: `Installed`)
            if not self._answers():  # (every rank failed: the votes saw to that)
                log.log(logging.WARNING if isinstance(exc, TensorHubError) else logging.ERROR,
                        "not applying v%d: %s", update_info.version, exc,
                        exc_info=not isinstance(exc, TensorHubError))
                return
            raise
        log.info("applied v%d in %.1f ms", update_info.version,
                 (time.perf_counter() - started) * 1e3)

    def _rank(self) -> int:
        from vllm.distributed import get_world_group

        return get_world_group().rank

    def _apply(self, update_info: TensorHubUpdateInfo) -> None:
        previous = self.applied
        try:
            self._apply_version(update_info.version, update_info.fetch)
        except TornLoad as torn:
            # (the ranks learn only that one failed, not why: any torn load from a share of
            # a version in tiles ends tile shares, which costs bytes, never answers; a
            # stage's layers are its own parameters' names, no rule that could mislead)
            if self.checkpoint is not None and self.checkpoint.replica.share_layout is not None:
                self._whole_versions = True
                self.checkpoint.pull_whole_versions(f"loading v{update_info.version} from "
                                                    f"this node's share failed ({torn})")
            try:
                restore_after(torn, previous, lambda v: self._apply_version(v, fetch=True),
                              self._load_checkpoint)
            except InstallFailed as exc:
                if exc.outcome.kind in ("restored_checkpoint", "torn"):
                    self.applied = None  # (torn: no version is whole in the model)
                raise

    def _apply_version(self, version: int, fetch: bool = False) -> None:
        self._installed_as = "whole"  # (until a sparse install says otherwise)
        if self.one_copy:  # each node's copy, mapped by the node's other ranks
            apply_shared(version, lambda named: self._load(named, self._share_layout()),
                         self._broadcast, self._agree, checkpoint=self.checkpoint,
                         reader=self._shared, fetch=fetch)
        elif self.checkpoint is None:  # (init failed here): the other ranks must still hear it
            self._agree(False)
            raise TensorHubError("TensorHub engine not initialised on this rank")
        else:
            with self.checkpoint.tensors_of(version, self._agree, fetch=fetch) as named:
                self._install(version, named)
        self.applied = version

    def _install(self, version: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """The engine's reload of `named`; on an fp8 engine that quantized `version` before
        the pause, its fp8 layers and the parameters it can place written instead, and only
        the rest reloaded."""
        quantized, self._quantized = self._quantized, None
        plan, self._plan = self._plan, None
        if self._layout_recipe is not None:
            self._install_layout(version, named, quantized, plan)
            return
        if plan is not None and plan.version == version and plan.key == self._live_key() \
                and self.checkpoint.prepared(version):
            started = time.perf_counter()
            with self._writing():
                sparse_install.install(plan)
                self._after_writes(plan.params)
            self._installed_as = "sparse"
            log.info("TensorHub: v%d installed sparse: %d of %d elements written in %.1f ms",
                     version, plan.changed, plan.total, (time.perf_counter() - started) * 1e3)
            return
        if self._fp8_direct and quantized is not None and quantized[0] == version \
                and self.checkpoint.prepared(version):
            try:
                with self._writing():
                    rest = fp8_install.write(self.model, quantized[1], named)
                if rest:
                    self._load(rest)
            except Exception:
                self._fp8_direct = False  # (the restore, and every version after, reload)
                log.exception("TensorHub: writing the quantized v%d failed; from now on "
                              "vLLM's reload quantizes each version", version)
                raise
            return
        self._load(named, self._share_layout())
        if self._fp8_direct is None:
            self._fp8_direct = self._quantizes_as_vllm(named)

    def _quantizes_as_vllm(self, named: list[tuple[str, torch.Tensor]]) -> bool:
        """Whether the live fp8 weights vLLM's reload just made from `named` are byte for
        byte what `fp8_install.quantize` makes of them (logged either way)."""
        started = time.perf_counter()
        try:
            same = fp8_install.matches(self.model, fp8_install.quantize(self.model, named))
            why = "vLLM's own quantization gave the same bytes" if same else \
                "its bytes differ from vLLM's own quantization"
        except Exception as exc:
            same, why = False, f"quantizing it failed ({exc})"
        log.info("TensorHub: fp8 versions are quantized %s: %s (checked in %.0f ms)",
                 "before the pause" if same else "by vLLM's reload, inside the pause", why,
                 (time.perf_counter() - started) * 1e3)
        return same

    def _load_checkpoint(self) -> None:
        """Load the checkpoint the engine started from again, on every rank."""
        if self.vllm_config.load_config.load_format == "dummy":
            raise TensorHubError("it started with --load-format dummy: no checkpoint")
        failure = None
        try:
            self._load(checkpoint_tensors(self.vllm_config.model_config.model))
        except Exception as exc:
            failure = exc
        if not self._agree(failure is None):
            raise failure or TensorHubError("another rank could not load the checkpoint")

    def _broadcast(self, payload: bytes | None) -> bytes:
        return self._node_broadcast().broadcast(payload)

    def _share_layout(self) -> str | None:
        """How the version this rank loads is tiled, when it loads its node's share."""
        if self.checkpoint is not None:
            return self.checkpoint.replica.share_layout
        return self._shared.share_layout if self._shared is not None else None

    def _load(self, named, share_layout: str | None = None) -> None:
        """vLLM's layerwise reload of `named`; after the first load from a share of a
        version tiled as `share_layout`, the live parameters scanned for rows it read
        outside the share (`ShareCheck`)."""
        self._reload(named)
        self._share_check.after_load(self.model.named_parameters(), share_layout)

    @contextmanager
    def _writing(self):
        """Around every write of the live weights: the count moves before and after, so
        a sparse plan compared with them meanwhile is never installed."""
        self._writes += 1
        try:
            yield
        finally:
            self._writes += 1

    def _after_writes(self, written: list[str]) -> None:
        """What vLLM derives from a weight after loading it, made again for the modules
        whose weights a sparse install wrote (on CPU, a packed GEMM copy of an embedding
        or LM head it keeps beside the weight; a tied LM head shares the embedding's)."""
        if self.device.type != "cpu":
            return  # (unquantized weights on a GPU: nothing is derived from them)
        params = dict(self.model.named_parameters())
        wanted = {id(params[name]) for name in written}
        for module in self.model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None and any(id(p) in wanted
                                          for p in module.parameters(recurse=False)):
                method.process_weights_after_loading(module)

    def _reload(self, named) -> None:
        with self._writing():
            self._reload_now(named)

    def _reload_now(self, named) -> None:
        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(iter(named))
        except BaseException:
            # Never leave layers on the meta device: the layers it reached hold the new
            # version, the others get their old tensors back (the caller then loads a
            # whole version).
            try:
                finalize_layerwise_reload(self.model, self.model_config)
            except Exception as exc:
                log.warning("finishing the failed reload: %s", exc)
            raise
        finalize_layerwise_reload(self.model, self.model_config)
        if getattr(self.model_config.hf_config, "tie_word_embeddings", False) and \
                hasattr(self.model, "lm_head") and hasattr(self.model.lm_head, "quant_method"):
            # A tied lm_head shares the embedding's parameter but keeps its own packed
            # CPU GEMM, which the layerwise reload does not redo: redo it.
            self.model.lm_head.quant_method.process_weights_after_loading(self.model.lm_head)

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        self._checks.close()
        self._quantized = None
        if self.checkpoint is not None:
            self.checkpoint.close()
            self.checkpoint = None


def _default_loader():
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    return default_weight_loader
