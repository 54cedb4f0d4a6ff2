"""sonar-fx benchmarks: one script per family of questions, `python -m benchmarks.NAME [--quick] [--OPTION]`.

methods       paper Table 1: every method x execution mode (memory, step time, held-out loss);
              --granularity (Table 3: batched vs per-expert updates), --batch-sweep (section 5.5: the
              saving and speedup as the batch grows), --accumulation (Table 8, and the deferred
              schedule), --deferred (docs/modes.md: which path saves, and at what time, under the clip
              over every parameter), --timeline (live memory through one step), --profile (where the
              update's time goes, beside the same update done the plain way)
compile       compile time with and without the pass, regional vs whole-model; --endurance (2,000 steps:
              RSS flat, no recompiles, steady step time)
keep_budget   the deferred step's keep budget: step time against memory at budget 0, 1/4, 1/2, all
optimizers    optimizers, clipping modes, logged norms, low-bit states; --only muon (Muon's table)
distributed   gradient memory per distributed engine (DDP, FSDP2, EP, the 2-D layout)
distributed_deferred  the deferred schedule per rank on DDP and EP: memory, time, the planner's peak;
              --timeline (each expert gradient's all-reduce in flight while the next is computed)
plan_accuracy `sonar-fx plan` against a measured step and the paper
readme        regenerates the docs' Results pages and the README headline from results/*/results.json

Each option writes results/<its name>/ (`methods --batch-sweep`: results/batch_sweep/). Elsewhere, with
the same harness: the correctness tables the tests' own runners fill (`python -m tests.families`,
`python -m tests.saving_cases`) and the prepared GPU scripts (`python -m scripts.gpu.olmoe`,
`python -m scripts.gpu.kernels`). Shared code: `common` (environment header, grading, tables, results
I/O, CLI), `goals` (every goal's threshold and wording), `workload` (model shapes), `arms` (build the arms
of one comparison and measure them), `handwritten` (the tutorial's hooks), `profiles` (one step under the
profiler). The measuring itself is `sonar_fx.measure`, which the demo shares; the data `sonar_fx.workload`.
"""

SCRIPTS = (
    "benchmarks.methods",
    "benchmarks.compile",
    "benchmarks.keep_budget",
    "benchmarks.optimizers",
    "benchmarks.distributed",
    "benchmarks.distributed_deferred",
    "benchmarks.plan_accuracy",
    "tests.families",
    "tests.saving_cases",
    "scripts.gpu.olmoe",
    "scripts.gpu.kernels",
)
"""Every module that writes results/ (`benchmarks.readme` reads each one's SCRIPT, MODES and question)."""
