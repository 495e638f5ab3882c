"""Test and benchmark tooling, never imported by the runtime: the process harness, chaos and soak,
random models, hostile requests and the bench suites (bench/)."""
