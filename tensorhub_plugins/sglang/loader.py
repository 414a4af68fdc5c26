"""SGLang custom weight loader: `--custom-weight-loader tensorhub_plugins.sglang.loader.apply`.

SGLang calls `apply(model, named_tensors)` in the scheduler from
`/update_weights_from_tensor`. TensorHub sends no weights through that request, only a
descriptor in a tensor's name (`tensorhub:{"version": N}` with an empty tensor); the bytes
come from the holder, pulled beforehand. It never raises: an exception here would kill the
server. Failures are logged and recorded for the driver, and the model is left untouched.
"""

from __future__ import annotations

import json
import logging

from pydantic import BaseModel, ConfigDict, Field

from tensorhub_plugins.sglang import worker

log = logging.getLogger("tensorhub.sglang")
PREFIX = "tensorhub:"


class Descriptor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=1)


def apply(model, named_tensors) -> None:
    try:
        names = [name for name, _ in named_tensors if str(name).startswith(PREFIX)]
        if len(names) != 1:
            raise ValueError(f"expected one '{PREFIX}{{...}}' descriptor, got {len(names)}")
        desc = Descriptor.model_validate(json.loads(names[0][len(PREFIX):]))
        worker.apply(model, desc.version)
    except Exception as exc:
        log.error("TensorHub update refused, weights unchanged: %s", exc)
        try:
            worker.record(worker._holder.applied if worker._holder else None, str(exc))
        except Exception:
            pass
