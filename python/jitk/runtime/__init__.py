"""The runtime floor: the op layer (jitk.op, reference mode), the registry of kernel families,
streams."""
