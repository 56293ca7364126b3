// y[i] += a * x[i] over a grid-stride loop; the contract suite's launch test for CUDA/HIP backends.
extern "C" __global__ void hal_test_axpy(const float* x, float* y, float a, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        y[i] += a * x[i];
    }
}
