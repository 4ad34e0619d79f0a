"""Patches for vLLM, one module per cause (each with a why-comment and a test under tests/compat/vllm/).

Kept import-light: :mod:`.cpu` runs at every interpreter start (a ``.pth`` start-up hook), so this
package imports nothing.
"""
