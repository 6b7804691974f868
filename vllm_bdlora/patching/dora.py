"""Patches that carry DoRA magnitude vectors through vLLM's adapter loader and into the LoRA slots.

vLLM has no notion of per-adapter tensors beyond LoRA A and B: its checkpoint parser raises on
`lora_magnitude_vector`, and slot activation copies A and B only.
"""

from __future__ import annotations

import inspect

from vllm_bdlora.dora import as_lora_a_name, is_magnitude_tensor
from vllm_bdlora.patching import UpstreamContractError, original_of, require_parameters, wrap_method


def patch_dora_magnitude_tensors() -> bool:
    """Let vLLM's checkpoint reader accept magnitude vectors, and keep them aside on the LoRAModel
    (`bdlora_dora_magnitudes`, keyed by vLLM module name) for `vllm_bdlora.loading`."""
    import vllm.lora.lora_model as lora_model_module
    from vllm.lora.lora_model import LoRAModel

    from vllm_bdlora.loading import DORA_MAGNITUDES

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
            magnitudes = {name: t for name, t in tensors.items() if is_magnitude_tensor(name)}
            if magnitudes:
                rest = {name: t for name, t in tensors.items() if name not in magnitudes}
                if "tensors" in kwargs:
                    kwargs["tensors"] = rest
                else:
                    args = (args[0], rest, *args[2:])
            model = original(cls, *args, **kwargs)
            mapper = kwargs.get("weights_mapper")
            unwrapped = original_of(lora_model_module.parse_fine_tuned_lora_name) or parse
            by_module = {}
            for name, tensor in magnitudes.items():
                module, _ = unwrapped(as_lora_a_name(name), mapper)
                by_module[module] = tensor.detach().float().cpu()
            setattr(model, DORA_MAGNITUDES, by_module)
            return model

        return from_lora_tensors

    return wrap_method(LoRAModel, "from_lora_tensors", make) or changed


def patch_dora_scales_into_slots() -> bool:
    """After vLLM copies an adapter's A and B into a slot, copy its DoRA magnitude scales into the
    same slot of each layer (layers reset them to 1 in `set_lora`/`reset_lora`)."""
    from vllm.lora.model_manager import LoRAModelManager

    from vllm_bdlora.layers import BlockDiagonalLoRALayer
    from vllm_bdlora.loading import DORA_SCALES

    require_parameters(LoRAModelManager.activate_adapter, ("lora_id",), "LoRAModelManager.activate_adapter")
    source = inspect.getsource(inspect.unwrap(LoRAModelManager.__init__))
    for attr in ("lora_index_to_id", "_registered_adapters", "packed_modules"):
        if f"self.{attr}" not in source:
            raise UpstreamContractError(f"vllm-bdlora: LoRAModelManager.__init__ no longer sets {attr}.")

    def make(original):
        def activate_adapter(self, lora_id, *args, **kwargs):
            activated = original(self, lora_id, *args, **kwargs)
            if not activated:
                return activated
            scales = getattr(self._registered_adapters[lora_id], DORA_SCALES, None)
            if scales:
                index = self.lora_index_to_id.index(lora_id)
                for name, layer in self.modules.items():
                    if isinstance(layer, BlockDiagonalLoRALayer) and layer.dora_scale is not None:
                        sub_modules = self.packed_modules.get(name) or [name]
                        per_slice = [scales.get(sub) for sub in sub_modules]
                        if any(s is not None for s in per_slice):
                            layer.set_dora_scale(index, per_slice)
            return activated

        return activate_adapter

    return wrap_method(LoRAModelManager, "activate_adapter", make)
