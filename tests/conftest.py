"""Test-session setup shared by every test module."""

# triton's native library (which torchvision imports through torch._dynamo) crashes the
# process when it is loaded after TensorFlow's; loading the PyTorch references first is safe.
import timm  # noqa: F401
import torchvision  # noqa: F401
