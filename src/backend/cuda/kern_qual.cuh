/*
 * Qualifiers of the kernels that the SIMT emulator (simt_emu.cuh) also compiles as host code
 * (MQM_EMU): moe_kernels.cuh's, attn_kernels.cuh's, kvattn_kernels.cuh's, dequant_kernels.cuh's.
 * In the CUDA build they are the plain CUDA qualifiers; under the emulator kernels and device
 * functions are inline host functions and shared memory is the emulator's (one array per name
 * and block).
 */
#ifndef MOEQ_BACKEND_CUDA_KERN_QUAL_CUH
#define MOEQ_BACKEND_CUDA_KERN_QUAL_CUH

#ifdef MQM_EMU
#define MQD inline
#define MQHD inline
#define MQDF inline
#define MQHDC
#define MQ_KERNEL(n) inline void
#define MQ_KERNEL2(n, m) inline void
#define MQ_KERNEL0 inline void
#define MQ_UNROLL
#else
#define MQD __device__ __forceinline__
#define MQHD __host__ __device__ __forceinline__
#define MQDF __device__
#define MQHDC __host__ __device__
#define MQ_KERNEL(n) __global__ void __launch_bounds__(n)
#define MQ_KERNEL2(n, m) __global__ void __launch_bounds__(n, m)
#define MQ_KERNEL0 __global__ void
#define MQ_UNROLL _Pragma("unroll")
#define MQ_DYN_SMEM(name) extern __shared__ __align__(16) uint8_t name[]
#define MQ_SHARED(T, name) __shared__ T name
#define MQ_SHARED_ARR(T, name, dims) __shared__ T name dims
#endif

#endif
