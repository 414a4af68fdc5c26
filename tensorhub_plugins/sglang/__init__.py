"""SGLang plugin for TensorHub (issue 4): a custom weight loader driven through SGLang's
weight-update endpoints, and elastic start-up."""
