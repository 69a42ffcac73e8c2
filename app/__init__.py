"""The application layer: the `awrl` CLI, training runs, the learning loop and the demo.

It wires the layers below together and nothing imports it (`pyproject.toml`'s import contract)."""
