"""What the AutoTP engine tests (tests/integrations/test_deepspeed_autotp*.py) compare with:
an AutoTP-sharded parameter gathered back to the full one, and a relative error.

Not a test module; imported as ``tests.helpers.autotp``, in the ranks too.
"""
import torch


def gathered(module, name, p, group):
    """The full parameter ``name`` of ``module`` from AutoTP's shards over ``group`` (split dim
    1 for the row-parallel ``LinearAllreduce``, else 0; a replicated parameter as it is).
    Collective over ``group`` for a sharded one."""
    import torch.distributed as dist
    from deepspeed.module_inject.layers import LinearAllreduce

    if not getattr(p, "tensor_model_parallel", False):
        return p.detach().clone()
    owner = module.get_submodule(name.rsplit(".", 1)[0])
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, p.detach().clone(), group=group)
    return torch.cat(parts, dim=1 if isinstance(owner, LinearAllreduce) else 0)


def relative_error(a, b):
    """``|a - b| / |b|`` (Frobenius), ``a`` taken to ``b``'s float64."""
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))
