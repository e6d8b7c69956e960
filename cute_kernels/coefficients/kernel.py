"""The mHC coefficients kernel (CONTRACT §3, `mhc_pre_delayed`): the projection, layer-input and epilogue roles
composed into one or two launches.

Schedule "tile": one launch of clusters; the projection clusters exchange their partials in the cluster,
meet by the ticket handoff, and the last CTA of a row tile finishes its rows. Schedule "partials": the
projection CTAs store their sums and exit, a second launch (PDL) of one CTA per row finishes them in the
same order (the same bits); without a layer input the first launch has no clusters at all. With a layer
input (the inline form) the first launch also runs the layer-input clusters, after the projection
clusters of the tile whose rows they read. DeepSeek-V4's own-pre layer input ("own") is written by the CTAs that
finish the rows, with the pre they compute (own_input.py): schedule "tile" is then one launch for the mixes and the
layer input together.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from cute_kernels.coefficients.config import CLUSTER, CoefficientsConfig, projection_width
from cute_kernels.coefficients.epilogue import EpilogueRole
from cute_kernels.coefficients.layer_input import INLINE_BUDGET, LayerInputRole, cluster_prologue
from cute_kernels.coefficients.projection import ProjectionRole

OWN = "own"  # the layer-input mode of DeepSeek-V4's own-pre layer input (CONTRACT §4d)


class CoefficientsKernel:
    """post, comb and next pre of CONTRACT §3 (plus, inline, the layer input); variant and shape compile-time.

    `variant` "standard" projects the streams [T, 4, H], "broadcast" the first layer's embedding [T, H];
    `layer_input` "none", "carried" (the carried pre-mix collapse) or "one_hot" (stream 0 / the embedding
    row), RMSNorm'd, or with the suffix "_unnormed" the collapse itself (no norm weight), or "own" (the streams
    collapsed with the pre this launch computes, RMSNorm'd; with `quant` one of QUANT_FORMS beside bf16); `config`
    None is H's split with the default knobs (the shipped 32-row tile).
    """

    def __init__(
        self,
        H: int,
        *,
        variant: str = "standard",
        layer_input: str = "none",
        sinkhorn_repeat: int = 20,
        config: CoefficientsConfig | None = None,
        quant: str | None = None,
    ) -> None:
        broadcast = variant == "broadcast"
        config = config if config is not None else CoefficientsConfig.for_shape(H, broadcast)
        self.layer_input = layer_input
        self.schedule = config.schedule
        self.min_blocks = config.min_blocks
        self.own = layer_input == OWN
        if self.own and broadcast:
            raise ValueError("the own-pre layer input collapses the streams: variant must be 'standard'")
        if quant is not None and not self.own:
            raise ValueError(f"quant {quant!r} needs the own-pre layer input (layer_input={OWN!r})")
        self.epilogue = EpilogueRole(
            projection_width(H, broadcast),
            sinkhorn_repeat,
            config.threads,
            config.groups,
            own_input=H if self.own else None,
            share=config.rows_per_tile // CLUSTER,
            quant=quant,
        )
        self.projection = ProjectionRole(H, broadcast, config, self.epilogue)
        self.inputs = None  # the layer-input clusters (the inline form)
        if layer_input not in ("none", OWN):
            cta_warps = config.warps * config.row_split
            self.inputs = LayerInputRole(H, broadcast, layer_input, cta_warps, INLINE_BUDGET)
            self.norm_per_tile = config.rows_per_tile // self.inputs.norm_rows  # layer-input clusters per tile

    def grid_clusters(self, rows: int | Int32) -> int | Int32:
        """The first launch's grid y extent for `rows` rows (an int, or the dynamic row count): per row tile
        its G projection clusters (CTA groups of schedule "partials"), then, inline, its layer-input clusters."""
        tiles = (rows + (self.projection.tm - 1)) // self.projection.tm
        if self.inputs is None:
            return tiles * self.projection.groups
        return tiles * (self.projection.groups + self.norm_per_tile)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [T, 4, H] bf16 streams, or [T, H] bf16 embedding (broadcast)
        mFn: cute.Tensor,  # [24, K] fp32
        mScale: cute.Tensor,  # [3] fp32
        mBase: cute.Tensor,  # [24] fp32
        mPost: cute.Tensor,  # [T, 4] fp32
        mComb: cute.Tensor,  # [T, 4, 4] fp32, [src, dst]
        mPre: cute.Tensor,  # [T, 4] fp32 (next pre)
        mPartial: cute.Tensor,  # [>= G, >= T, 25] fp32 workspace ([>= 8G, >= T, 25] for schedule "partials")
        mCounter: cute.Tensor,  # [>= ceil(T/16)*8] int32 workspace, zero between calls
        mPreMix: cute.Tensor | None,  # [T, 4] fp32 carried pre (the carried collapse)
        mW: cute.Tensor | None,  # [H] bf16 norm weight (inline form, normalised)
        mOut: cute.Tensor | None,  # [T, H] bf16 layer input (inline form)
        mQ: cute.Tensor | None,  # [T, H] e4m3 (own with quant)
        mQScale: cute.Tensor | None,  # MXFP8: [roundup(T, 128) * H/32] uint8, swizzled; FP8 1x128: [H/128, T_pad] fp32
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
        norm_eps: Float32,
        stream: cuda.CUstream,
    ):
        proj = self.projection
        rows = mX.shape[0]
        if const_expr(self.schedule == "partials" and self.inputs is None):
            self.partials_kernel(mX, mFn, mPartial).launch(
                grid=[CLUSTER, self.grid_clusters(rows), 1],
                block=[proj.threads, 1, 1],
                stream=stream,
                use_pdl=True,
                min_blocks_per_mp=self.min_blocks,
                preferred_smem_carveout=100 if self.min_blocks > 1 else None,
            )
        else:
            # With a layer input the partials schedule keeps this launch (its layer-input clusters
            # exchange sums of squares); its projection clusters skip the exchange and the handoff.
            self.kernel(
                mX,
                mFn,
                mScale,
                mBase,
                mPost,
                mComb,
                mPre,
                mPartial,
                mCounter,
                mPreMix,
                mW,
                mOut,
                mQ,
                mQScale,
                rms_eps,
                pre_eps,
                sinkhorn_eps,
                post_mult,
                norm_eps,
            ).launch(
                grid=[CLUSTER, self.grid_clusters(rows), 1],
                block=[proj.threads, 1, 1],
                cluster=[CLUSTER, 1, 1],
                stream=stream,
                use_pdl=True,
                min_blocks_per_mp=self.min_blocks,
                # The largest carveout, so shared memory does not cap the CTAs per SM below the bound.
                preferred_smem_carveout=100 if self.min_blocks > 1 else None,
            )
        if const_expr(self.schedule == "partials"):
            finish = (mScale, mBase, mPost, mComb, mPre, mPartial, rms_eps, pre_eps, sinkhorn_eps, post_mult)
            if const_expr(self.own):
                finisher = self.epilogue.own_finish_kernel(*finish, mX, mW, mOut, mQ, mQScale, norm_eps)
            else:
                finisher = self.epilogue.finish_kernel(*finish)
            finisher.launch(
                grid=[rows, 1, 1],
                block=[self.epilogue.finish_threads, 1, 1],
                stream=stream,
                use_pdl=True,
            )

    @cute.kernel
    def kernel(
        self,
        mX: cute.Tensor,
        mFn: cute.Tensor,
        mScale: cute.Tensor,
        mBase: cute.Tensor,
        mPost: cute.Tensor,
        mComb: cute.Tensor,
        mPre: cute.Tensor,
        mPartial: cute.Tensor,
        mCounter: cute.Tensor,
        mPreMix: cute.Tensor | None,
        mW: cute.Tensor | None,
        mOut: cute.Tensor | None,
        mQ: cute.Tensor | None,
        mQScale: cute.Tensor | None,
        rms_eps: Float32,
        pre_eps: Float32,
        sinkhorn_eps: Float32,
        post_mult: Float32,
        norm_eps: Float32,
    ):
        """The clusters of the one-launch grid: per tile its G projection clusters, then (inline) the
        layer-input clusters of its rows."""
        rank, cluster_id, smem, mbar = cluster_prologue()
        # What a projection cluster takes besides its index among the projection clusters.
        tile_args = (smem, mbar, mX, mFn, mScale, mBase, mPost, mComb, mPre, mPartial, mCounter)
        tile_args += (rms_eps, pre_eps, sinkhorn_eps, post_mult, rank)
        if const_expr(self.inputs is not None):
            # Which role this cluster plays, and its index among the clusters of that role.
            block = const_expr(self.projection.groups + self.norm_per_tile)
            tile = cluster_id // block
            k = cluster_id - tile * block
            norm = k >= self.projection.groups
            norm_cluster = tile * self.norm_per_tile + k - self.projection.groups
            proj_cluster = tile * self.projection.groups + k
            if norm:
                # A cluster past the last row (the tail of the grid) has nothing to do.
                if norm_cluster * self.inputs.norm_rows < mX.shape[0]:
                    self.inputs.cluster_cta(smem, mbar, mX, mPreMix, mW, mOut, norm_eps, rank, norm_cluster)
            elif const_expr(self.schedule == "partials"):
                self.projection.partials_cta(smem, mX, mFn, mPartial, rank, proj_cluster)
            else:
                self.projection.tile_cta(*tile_args, proj_cluster)
        elif const_expr(self.own):
            self.projection.tile_cta(*tile_args, cluster_id, (mX, mW, mOut, mQ, mQScale, norm_eps))
        else:
            self.projection.tile_cta(*tile_args, cluster_id)

    @cute.kernel
    def partials_kernel(self, mX: cute.Tensor, mFn: cute.Tensor, mRank: cute.Tensor):
        """Schedule "partials", first launch without a layer input: the projection CTAs, no clusters."""
        rank, cluster, _ = cute.arch.block_idx()
        self.projection.partials_cta(cutlass.memory.SmemAllocator(), mX, mFn, mRank, rank, cluster)
