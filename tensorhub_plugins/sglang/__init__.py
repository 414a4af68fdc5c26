"""SGLang plugin for TensorHub.

- entry point `sglang.srt.plugins` → `plugin.register` (runs in SGLang's main, scheduler and
  detokenizer processes): in the scheduler it hooks model loading to keep a checkpoint-layout
  holder beside the model and to join at the newest version before serving; in the main
  process it starts the driver that follows new versions through SGLang's own
  weight-update endpoints;
- `loader.apply`: the custom weight loader those endpoints call inside the scheduler
  (`--custom-weight-loader tensorhub_plugins.sglang.loader.apply`).
"""
