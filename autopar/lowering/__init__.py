"""What a plan means for the per-rank program, decided in one place.

The planner prices a plan, the codegen emits it and the runtime executes it; each of them needs the
same facts about the captured graph and the plan, and each used to work them out for itself. This
package holds those facts once, and all three read them:

- :mod:`autopar.lowering.graph`: facts of the captured graph (a node's tensor values, the arguments
  an op writes into, the one name a tied parameter is stored under);
- :mod:`autopar.lowering.chunks`: which edge of a matmul runs in chunks, along which dim, and which
  collectives launch asynchronously;
- :mod:`autopar.lowering.rows`: which ops act row-wise along a dim, so that a chunk chain crosses
  them (the codegen's chains and the planner's chain walk);
- :mod:`autopar.lowering.program`: the lowered per-rank program of a plan (:class:`Lowered`): every
  edge's collectives and the copies consumers share, every parameter's gradient placement and
  bucket, the recomputed regions and stage cuts. The codegen emits from it; the planner's
  collective list, memory replay and regather pricing read it; ``autopar.validate`` checks it;
- :data:`GRAD_BUCKET_BYTES`: the size of the gradient buckets the runtime fills and the planner
  prices.

The layering rule (``tests/test_layering.py``): this package imports none of ``autopar.planner``,
``autopar.codegen`` or ``autopar.runtime``; the planner imports neither codegen nor runtime.
"""

#: Bytes of one gradient bucket of the data-parallel reduction (DDP's default, 25 MiB): the runtime's
#: ``GradSync`` fills buckets of this size, the planner's collective count and memory replay price them.
GRAD_BUCKET_BYTES = 25 * 2**20
