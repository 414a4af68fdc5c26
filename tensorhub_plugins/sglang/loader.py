"""SGLang custom weight loader: `--custom-weight-loader tensorhub_plugins.sglang.loader.apply`.

SGLang calls `apply(model, named_tensors)` in the scheduler from
`/update_weights_from_tensor`. TensorHub sends no weights through that request, only a
descriptor in a tensor's name (`tensorhub:{"version": N, "path": "native"}` with an empty
tensor); the bytes come through TensorHub: straight into the live parameters from a
same-layout peer (`native`), or from the checkpoint-layout copy through the model's
`load_weights` (`checkpoint`, the default). It never raises: an exception here would kill
the server. Failures are logged and recorded for the driver.
"""

from __future__ import annotations

import json
import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tensorhub_plugins.sglang import worker

log = logging.getLogger("tensorhub.sglang")
PREFIX = "tensorhub:"


class Descriptor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=1)
    path: Literal["native", "checkpoint"] = "checkpoint"


def apply(model, named_tensors) -> None:
    scheduler = worker.current()
    try:
        names = [name for name, _ in named_tensors if str(name).startswith(PREFIX)]
        if len(names) != 1:
            raise ValueError(f"expected one '{PREFIX}{{...}}' descriptor, got {len(names)}")
        desc = Descriptor.model_validate(json.loads(names[0][len(PREFIX):]))
        if scheduler is None:
            raise RuntimeError("TensorHub is not running in this scheduler")
        scheduler.apply(model, desc.version, desc.path)
    except Exception as exc:
        torn = scheduler is not None and scheduler.torn
        log.error("TensorHub update refused%s: %s",
                  " and the weights are torn" if torn else ", weights unchanged", exc)
        try:
            if scheduler is not None:
                scheduler.refused(exc)
        except Exception:
            pass
