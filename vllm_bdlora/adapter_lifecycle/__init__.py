"""An adapter's way from a load request to a GPU slot and out again: admit (engine core), read and cut (workers'
admission threads), finish, the workers' host tier and spill, slot fills, unload. README.md beside this file has the
diagram; each module is one stage, and its docstring says which process runs it."""
