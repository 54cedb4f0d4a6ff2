"""Expert tensors: discovery, layouts and the expert kernels that compute with them."""
