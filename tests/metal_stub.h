// What the Metal Shading Language and MLX's kernel prelude (metal_stdlib, `using namespace metal`,
// bfloat16_t) give our kernels, declared for clang's C++17 front end so that tests/test_metal.py can
// compile the Metal form of every kernel body on a machine without Apple's compiler. Declarations
// only: nothing here runs. Only what our kernels use is declared; anything else is an error, as a
// CUDA name left in a respelled body should be.
#pragma once

// Address spaces as clang's address-space qualifiers, so that passing a pointer of one space where
// another is expected is an error as in MSL. `thread` (a function's own memory) is C++'s default.
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread
// MSL declares threadgroup arrays in a kernel function's scope, one per threadgroup: static storage
// as C++ sees it (C++ has no automatic variable in an address space). The wrapper switches the
// macro to this form before the kernel functions; in helper functions it stays an error, as in MSL.
#define METAL_KERNEL_THREADGROUP static __attribute__((address_space(3)))

#pragma clang poison double  // no double on Metal GPUs

typedef _Float16 half;
typedef __bf16 bfloat;
typedef half float16_t;  // MLX's names for its dtypes
typedef bfloat bfloat16_t;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned int uint32_t;
typedef uint uint3 __attribute__((ext_vector_type(3)));  // thread positions (.x, .y, .z)

namespace metal {
// Math: overloads for half, bfloat and float (an int argument is ambiguous, as in MSL).
#define METAL_STUB_MATH(f) half f(half); bfloat f(bfloat); float f(float);
METAL_STUB_MATH(rsqrt) METAL_STUB_MATH(exp) METAL_STUB_MATH(exp2) METAL_STUB_MATH(sin) METAL_STUB_MATH(cos)
#undef METAL_STUB_MATH
half fmax(half, half); bfloat fmax(bfloat, bfloat); float fmax(float, float);

// Reinterpreting bits: MSL requires both types to have the same size.
template <typename T, typename U> T as_type(U v) {
  static_assert(sizeof(T) == sizeof(U), "as_type: the two types differ in size");
  return __builtin_bit_cast(T, v);
}

// SIMD-group (32 lanes on Apple GPUs) reductions and shuffles, and the threadgroup barrier.
template <typename T> T simd_sum(T);
template <typename T> T simd_max(T);
template <typename T> T simd_shuffle_xor(T, ushort);
enum class mem_flags { mem_none, mem_device, mem_threadgroup, mem_texture };
void threadgroup_barrier(mem_flags);
}  // namespace metal

using namespace metal;
