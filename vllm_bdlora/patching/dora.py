"""Patches that carry DoRA magnitude vectors through vLLM's adapter loader and into the LoRA slots.

vLLM has no notion of per-adapter tensors beyond LoRA A and B: its checkpoint parser raises on
`lora_magnitude_vector`, and slot activation copies A and B only.
"""

from __future__ import annotations

import inspect

from vllm_bdlora.dora import DoraAdapter, as_lora_a_name, is_magnitude_tensor, split_magnitudes
from vllm_bdlora.patching import UpstreamContractError, original_of, require_parameters, wrap_method


def patch_dora_magnitude_tensors() -> bool:
    """Let vLLM's checkpoint reader accept magnitude vectors, and keep them aside on the LoRAModel (a `DoraAdapter`,
    keyed by vLLM module name) for `vllm_bdlora.adapter_lifecycle.read_and_cut`."""
    import vllm.lora.lora_model as lora_model_module
    from vllm.lora.lora_model import LoRAModel

    parse = getattr(lora_model_module, "parse_fine_tuned_lora_name", None)
    if parse is None:
        raise UpstreamContractError("vllm-bdlora: vllm.lora.lora_model no longer imports parse_fine_tuned_lora_name.")
    require_parameters(LoRAModel.from_lora_tensors, ("tensors", "weights_mapper"), "LoRAModel.from_lora_tensors")
    changed = False
    if original_of(parse) is None:

        def parse_fine_tuned_lora_name(name, weights_mapper=None):
            # Only vLLM's unexpected-module check sees magnitude names (from_lora_tensors drops them first):
            # map them to their module's LoRA-A name so the module is checked like its A and B.
            return parse(as_lora_a_name(name) if is_magnitude_tensor(name) else name, weights_mapper)

        parse_fine_tuned_lora_name.__bdlora_original__ = parse
        lora_model_module.parse_fine_tuned_lora_name = parse_fine_tuned_lora_name
        changed = True

    def make(original):
        def from_lora_tensors(cls, *args, **kwargs):
            tensors = kwargs.get("tensors") if "tensors" in kwargs else args[1]
            rest, magnitudes = split_magnitudes(tensors)
            if "tensors" in kwargs:
                kwargs["tensors"] = rest
            else:
                args = (args[0], rest, *args[2:])
            model = original(cls, *args, **kwargs)
            module_of = original_of(lora_model_module.parse_fine_tuned_lora_name) or parse
            mapper = kwargs.get("weights_mapper")
            by_module = {module_of(as_lora_a_name(name), mapper)[0]: t.detach().float().cpu()
                         for name, t in magnitudes.items()}  # fmt: skip
            DoraAdapter(by_module).attach(model)
            return model

        return from_lora_tensors

    return wrap_method(LoRAModel, "from_lora_tensors", make) or changed


def patch_dora_scales_into_slots() -> bool:
    """After vLLM copies an adapter's A and B into a slot, copy its DoRA magnitude scales into the
    same slot of each layer (layers reset them to 1 in `set_lora`/`reset_lora`)."""
    from vllm.lora.model_manager import LoRAModelManager

    require_parameters(LoRAModelManager.activate_adapter, ("lora_id",), "LoRAModelManager.activate_adapter")
    source = inspect.getsource(inspect.unwrap(LoRAModelManager.__init__))
    for attr in ("lora_index_to_id", "_registered_adapters", "packed_modules"):
        if f"self.{attr}" not in source:
            raise UpstreamContractError(f"vllm-bdlora: LoRAModelManager.__init__ no longer sets {attr}.")

    def make(original):
        def activate_adapter(self, lora_id, *args, **kwargs):
            activated = original(self, lora_id, *args, **kwargs)
            if activated:
                DoraAdapter.of(self._registered_adapters[lora_id]).load_into_slot(
                    self, self.lora_index_to_id.index(lora_id)
                )
            return activated

        return activate_adapter

    return wrap_method(LoRAModelManager, "activate_adapter", make)
