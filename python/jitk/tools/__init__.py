"""The tools floor: call logging and replay, parity testing, tuning and its store,
precompile, timing, the environment report, a throw-away local OCI registry."""
