"""Expert kernel backends: one interface over the torch reference, ScatterMoE and SonicMoE."""
