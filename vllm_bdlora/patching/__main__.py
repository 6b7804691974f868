from vllm_bdlora.patching.registry import patch_table

print(patch_table(), end="")
