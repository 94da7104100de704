"""``ForwardingOptimizer``: the base of optimizer wrappers that forward Megatron's calls by name.

megatron.training holds one optimizer object and calls a known set of members on it (its training
loop, checkpointing, logging and the LR scheduler). A wrapper derived from this base forwards
exactly those (``FORWARDED_METHODS``, ``FORWARDED_ATTRIBUTES``) to ``self.optimizer`` and refuses
any other member it does not define, naming it and where to add it: handing out the wrapped
optimizer's member silently could skip the wrapper (e.g. a second ``step``-like entry point).
"""
from __future__ import annotations

from typing import Any

#: methods of the wrapped optimizer that Megatron's training loop, checkpointing and logging call on
#: the optimizer it holds (megatron-core 0.19.2 training/training.py, checkpointing.py, utils;
#: megatron-core's optimizer param scheduler), forwarded as they are
FORWARDED_METHODS = (
    "zero_grad", "scale_loss", "get_loss_scale", "reload_model_params", "prepare_model_params_for_param_sync",
    "save_parameter_state", "load_parameter_state", "save_state_dict_to_file", "load_state_dict_from_file",
    "get_parameters", "get_main_grads_for_grad_norm", "clip_grad_norm", "count_zeros", "prepare_grads",
    "step_with_ready_grads", "get_grad_stats_parallel_group",
)
#: attributes read on the optimizer (``chained_optimizers`` only where the wrapped one is chained)
FORWARDED_ATTRIBUTES = ("param_groups", "is_stub_optimizer", "chained_optimizers", "state")


class ForwardingOptimizer:
    """Forwards ``FORWARDED_METHODS`` / ``FORWARDED_ATTRIBUTES`` to ``self.optimizer`` (module docstring)."""

    optimizer: Any

    def __getattr__(self, name):
        # Only called for members not found on the wrapper: the forwarded ones are defined on the
        # class (below), so anything reaching here is a member Megatron was not known to use.
        if name == "optimizer" or name.startswith("__"):
            raise AttributeError(name)
        if name in FORWARDED_ATTRIBUTES:
            raise AttributeError(f"the wrapped {type(self.optimizer).__name__} has no {name!r}")
        raise AttributeError(
            f"{type(self).__name__} has no member {name!r}: it forwards to the wrapped {type(self.optimizer).__name__} "
            f"only the members Megatron uses ({', '.join(FORWARDED_METHODS + FORWARDED_ATTRIBUTES)}). If Megatron "
            f"(or your code) needs {name!r}, add it to FORWARDED_METHODS or FORWARDED_ATTRIBUTES in "
            "megatron_sparseloco/megatron/forwarding.py, after checking that the outer loop "
            "(megatron_sparseloco/megatron/optimizer.py) does not need to act on it")


def _forward_method(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.optimizer, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The wrapped optimizer's ``{name}``."
    return method


def _forward_attribute(name: str):
    return property(lambda self: getattr(self.optimizer, name), doc=f"The wrapped optimizer's ``{name}``.")


for _name in FORWARDED_METHODS:
    setattr(ForwardingOptimizer, _name, _forward_method(_name))
for _name in FORWARDED_ATTRIBUTES:
    setattr(ForwardingOptimizer, _name, _forward_attribute(_name))
del _name

__all__ = ["FORWARDED_ATTRIBUTES", "FORWARDED_METHODS", "ForwardingOptimizer"]
