"""sonar-fx benchmarks: one script per question, each runnable as `python -m benchmarks.NAME [--quick]`.

methods           paper Table 1: every method x execution mode (memory, step time, held-out loss)
granularity       paper Table 3: batched (2L) vs per-expert (2EL) updates
batch_sweep       paper section 5.5: how the saving and speedup shrink as the batch grows
accumulation      paper Table 8: gradient accumulation A in {1, 2, 4, 8}
memory_timeline   a picture of live memory through one step (standard, sonar eager, sonar compiled)
compile_overhead  compile time with and without the pass; regional vs whole-model compilation
endurance         2,000 steps: RSS flat, no recompiles, steady step time
gpu               the prepared H200 script (full-size OLMoE-1B-7B shapes, random weights)
readme            regenerates the README "Results" section from results/*/results.json

Shared code: `common` (environment header, tables, results I/O, CLI), `workload` (model shapes) and
`arms` (build the arms of one comparison and measure them). The measuring itself (warm-up, memory
step, interleaved timed rounds, paired ratios, spreads) is `sonar_fx.measure`, which the demo shares;
the data is `sonar_fx.workload`.
"""
