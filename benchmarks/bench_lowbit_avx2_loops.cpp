// Isolated inner loops of the AVX2 low-bit decode (M = 1): cycles per 8 weights of each way to decode a format,
// 4 weight rows x 1024 codes (L1-resident, so memory plays no part), one token. These loops chose the decoders of
// csrc/cpu/linear_lowbit_isa.h (Note [AVX2 4-bit lookups by byte planes], Note [intx fields by lanes of whole
// codes], F8::wide); the kernel adds its tiles, group scales and prefetches on top.
//
//   g++ -O3 -std=c++17 -mavx2 -mfma -mf16c -w benchmarks/bench_lowbit_avx2_loops.cpp -o /tmp/loops && /tmp/loops 3.65
//
// The argument is the core's clock in GHz (CPU time x clock = cycles; 3.65 on the Zen 4 hosts here, measured with a
// chain of dependent imul). The "_cur" loops are the decoders before (two vpermps + blend per 8 nf4 / fp4 codes,
// 128-bit unpacks per 8 float8 bytes, pshufb + vpsrlvd per 8 intx codes); the weights are random bytes, which the
// loops only decode and multiply (no format's meaning is checked here: the kernel tests do that).
// fp8 / nf4 / fp4 / intx_magic keep 8 accumulators; intx_cur4 / intx_lanes4 4, as the kernel's tile does.
#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <cstring>
static double now(){timespec a; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&a); return a.tv_sec+a.tv_nsec*1e-9;}
alignas(64) uint8_t wbuf[4][2048];
alignas(64) float xb[2048];
alignas(64) float tbl[16] = {-1.f,-0.69f,-0.52f,-0.39f,-0.28f,-0.18f,-0.09f,0.f,0.079f,0.16f,0.24f,0.33f,0.44f,0.56f,0.72f,1.f};
#define T __attribute__((target("avx2,fma,f16c"),noinline))
// K weights per row, 4 rows, 8 accumulators
T float fp8_cur(int K, int reps) {
  __m256 acc[8]; for (auto& a: acc) a=_mm256_setzero_ps();
  const __m128i m = _mm_set1_epi16((short)0xBFFF);
  for (int r=0;r<reps;++r) for (int k=0;k<K;k+=8) {
#pragma GCC unroll 4
    for (int i=0;i<4;++i){ __m128i u=_mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i*)(wbuf[i]+k)));
      __m256 w=_mm256_cvtph_ps(_mm_and_si128(_mm_srai_epi16(u,1),m)); acc[i+4*((k>>3)&1)]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k),w,acc[i+4*((k>>3)&1)]);} }
  __m256 s=acc[0]; for(int i=1;i<8;++i) s=_mm256_add_ps(s,acc[i]); float o[8]; _mm256_storeu_ps(o,s); return o[0];
}
T float fp8_wide(int K, int reps) {
  __m256 acc[8]; for (auto& a: acc) a=_mm256_setzero_ps();
  const __m256i m = _mm256_set1_epi16((short)0xBFFF);
  for (int r=0;r<reps;++r) for (int k=0;k<K;k+=32) {
#pragma GCC unroll 4
    for (int i=0;i<4;++i){ __m256i v=_mm256_loadu_si256((const __m256i*)(wbuf[i]+k));
      __m256i lo=_mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(_mm256_setzero_si256(),v),1),m);
      __m256i hi=_mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(_mm256_setzero_si256(),v),1),m);
      acc[i]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k),_mm256_cvtph_ps(_mm256_castsi256_si128(lo)),acc[i]);
      acc[i+4]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+8),_mm256_cvtph_ps(_mm256_castsi256_si128(hi)),acc[i+4]);
      acc[i]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+16),_mm256_cvtph_ps(_mm256_extracti128_si256(lo,1)),acc[i]);
      acc[i+4]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+24),_mm256_cvtph_ps(_mm256_extracti128_si256(hi,1)),acc[i+4]);} }
  __m256 s=acc[0]; for(int i=1;i<8;++i) s=_mm256_add_ps(s,acc[i]); float o[8]; _mm256_storeu_ps(o,s); return o[0];
}
// nf4 current: 16 bytes -> 32 codes, pmovzx + 2 perm + blend
T float nf4_cur(int K, int reps) {
  __m256 acc[8]; for (auto& a: acc) a=_mm256_setzero_ps();
  const __m256 lo=_mm256_loadu_ps(tbl), hi=_mm256_loadu_ps(tbl+8);
  auto look=[&](__m256i i){return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo,i),_mm256_permutevar8x32_ps(hi,i),_mm256_castsi256_ps(_mm256_slli_epi32(i,28)));};
  for (int r=0;r<reps;++r) for (int k=0;k<K;k+=32) {
#pragma GCC unroll 4
    for (int i=0;i<4;++i){ __m128i c=_mm_loadu_si128((const __m128i*)(wbuf[i]+k/2));
      __m256i z0=_mm256_cvtepu8_epi32(c), z1=_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(c,c));
      acc[i]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k),look(z0),acc[i]);
      acc[i+4]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+8),look(z1),acc[i+4]);
      acc[i]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+16),look(_mm256_srli_epi32(z0,4)),acc[i]);
      acc[i+4]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+24),look(_mm256_srli_epi32(z1,4)),acc[i+4]);} }
  __m256 s=acc[0]; for(int i=1;i<8;++i) s=_mm256_add_ps(s,acc[i]); float o[8]; _mm256_storeu_ps(o,s); return o[0];
}
// nf4 byte planes via pshufb: 32 bytes -> 64 codes
T float nf4_planes(int K, int reps) {
  __m256 acc[8]; for (auto& a: acc) a=_mm256_setzero_ps();
  alignas(16) uint8_t pl[4][16]; for(int j=0;j<16;++j){uint32_t b; memcpy(&b,&tbl[j],4); for(int p=0;p<4;++p) pl[p][j]=(b>>(8*p))&255;}
  __m256i P[4]; for(int p=0;p<4;++p) P[p]=_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)pl[p]));
  const __m256i m=_mm256_set1_epi8(15);
  for (int r=0;r<reps;++r) for (int k=0;k<K;k+=64) {
#pragma GCC unroll 4
    for (int i=0;i<4;++i){ __m256i v=_mm256_loadu_si256((const __m256i*)(wbuf[i]+k/2));
      __m256i n[2]={_mm256_and_si256(v,m),_mm256_and_si256(_mm256_srli_epi16(v,4),m)};
#pragma GCC unroll 2
      for(int h=0;h<2;++h){ __m256i p0=_mm256_shuffle_epi8(P[0],n[h]),p1=_mm256_shuffle_epi8(P[1],n[h]),p2=_mm256_shuffle_epi8(P[2],n[h]),p3=_mm256_shuffle_epi8(P[3],n[h]);
        __m256i a=_mm256_unpacklo_epi8(p0,p1),b=_mm256_unpackhi_epi8(p0,p1),c=_mm256_unpacklo_epi8(p2,p3),d=_mm256_unpackhi_epi8(p2,p3);
        const float* xx=xb+k+32*h;
        acc[i]=_mm256_fmadd_ps(_mm256_loadu_ps(xx),_mm256_castsi256_ps(_mm256_unpacklo_epi16(a,c)),acc[i]);
        acc[i+4]=_mm256_fmadd_ps(_mm256_loadu_ps(xx+8),_mm256_castsi256_ps(_mm256_unpackhi_epi16(a,c)),acc[i+4]);
        acc[i]=_mm256_fmadd_ps(_mm256_loadu_ps(xx+16),_mm256_castsi256_ps(_mm256_unpacklo_epi16(b,d)),acc[i]);
        acc[i+4]=_mm256_fmadd_ps(_mm256_loadu_ps(xx+24),_mm256_castsi256_ps(_mm256_unpackhi_epi16(b,d)),acc[i+4]);}} }
  __m256 s=acc[0]; for(int i=1;i<8;++i) s=_mm256_add_ps(s,acc[i]); float o[8]; _mm256_storeu_ps(o,s); return o[0];
}
// fp4 (sign-symmetric) bf16 planes: 2 pshufb
T float fp4_planes(int K, int reps) {
  __m256 acc[8]; for (auto& a: acc) a=_mm256_setzero_ps();
  __m256i P2=_mm256_set1_epi8(3), P3=_mm256_set1_epi8(0x40);
  const __m256i m=_mm256_set1_epi8(15), z=_mm256_setzero_si256();
  for (int r=0;r<reps;++r) for (int k=0;k<K;k+=64) {
#pragma GCC unroll 4
    for (int i=0;i<4;++i){ __m256i v=_mm256_loadu_si256((const __m256i*)(wbuf[i]+k/2));
      __m256i n[2]={_mm256_and_si256(v,m),_mm256_and_si256(_mm256_srli_epi16(v,4),m)};
#pragma GCC unroll 2
      for(int h=0;h<2;++h){ __m256i p2=_mm256_shuffle_epi8(P2,n[h]),p3=_mm256_shuffle_epi8(P3,n[h]);
        __m256i a=_mm256_unpacklo_epi8(p2,p3),b=_mm256_unpackhi_epi8(p2,p3);
        const float* xx=xb+k+32*h;
        acc[i]=_mm256_fmadd_ps(_mm256_loadu_ps(xx),_mm256_castsi256_ps(_mm256_unpacklo_epi16(z,a)),acc[i]);
        acc[i+4]=_mm256_fmadd_ps(_mm256_loadu_ps(xx+8),_mm256_castsi256_ps(_mm256_unpackhi_epi16(z,a)),acc[i+4]);
        acc[i]=_mm256_fmadd_ps(_mm256_loadu_ps(xx+16),_mm256_castsi256_ps(_mm256_unpacklo_epi16(z,b)),acc[i]);
        acc[i+4]=_mm256_fmadd_ps(_mm256_loadu_ps(xx+24),_mm256_castsi256_ps(_mm256_unpackhi_epi16(z,b)),acc[i+4]);}} }
  __m256 s=acc[0]; for(int i=1;i<8;++i) s=_mm256_add_ps(s,acc[i]); float o[8]; _mm256_storeu_ps(o,s); return o[0];
}
// int3-like: pshufb + srlv + perm per 8
T float intx_cur(int K, int reps) {
  __m256 acc[8]; for (auto& a: acc) a=_mm256_setzero_ps();
  const __m256i ctrl=_mm256_setr_epi8(0,1,-128,-128,0,1,-128,-128,0,1,-128,-128,1,2,-128,-128,1,2,-128,-128,1,2,-128,-128,2,3,-128,-128,2,3,-128,-128);
  const __m256i sh=_mm256_setr_epi32(0,3,6,1,4,7,2,5); const __m256 t=_mm256_setr_ps(-4,-3,-2,-1,0,1,2,3);
  for (int r=0;r<reps;++r) for (int k=0;k<K;k+=32) {
#pragma GCC unroll 4
    for (int i=0;i<4;++i){ const uint8_t* b=wbuf[i]+k*3/8;
      __m256i d0=_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)b)), d1=_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(b+6)));
#pragma GCC unroll 2
      for(int h=0;h<2;++h){ __m256i d=h?d1:d0;
        acc[i+4*h]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+16*h),_mm256_permutevar8x32_ps(t,_mm256_srlv_epi32(_mm256_shuffle_epi8(d,ctrl),sh)),acc[i+4*h]);
        acc[i+4*h]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+16*h+8),_mm256_permutevar8x32_ps(t,_mm256_srlv_epi32(_mm256_shuffle_epi8(_mm256_srli_si256(d,3),ctrl),sh)),acc[i+4*h]);}} }
  __m256 s=acc[0]; for(int i=1;i<8;++i) s=_mm256_add_ps(s,acc[i]); float o[8]; _mm256_storeu_ps(o,s); return o[0];
}
// int3-like: pshufb + sllv + and + or (1.0 + c/8 float), no perm
T float intx_magic(int K, int reps) {
  __m256 acc[8]; for (auto& a: acc) a=_mm256_setzero_ps();
  const __m256i ctrl=_mm256_setr_epi8(0,1,-128,-128,0,1,-128,-128,0,1,-128,-128,1,2,-128,-128,1,2,-128,-128,1,2,-128,-128,2,3,-128,-128,2,3,-128,-128);
  const __m256i sh=_mm256_setr_epi32(20,17,14,19,16,13,18,15); const __m256i mk=_mm256_set1_epi32(7<<20), one=_mm256_set1_epi32(0x3F800000);
  for (int r=0;r<reps;++r) for (int k=0;k<K;k+=32) {
#pragma GCC unroll 4
    for (int i=0;i<4;++i){ const uint8_t* b=wbuf[i]+k*3/8;
      __m256i d0=_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)b)), d1=_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(b+6)));
#pragma GCC unroll 2
      for(int h=0;h<2;++h){ __m256i d=h?d1:d0;
        auto f=[&](__m256i dd){return _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(_mm256_sllv_epi32(_mm256_shuffle_epi8(dd,ctrl),sh),mk),one));};
        acc[i+4*h]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+16*h),f(d),acc[i+4*h]);
        acc[i+4*h]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+16*h+8),f(_mm256_srli_si256(d,3)),acc[i+4*h]);}} }
  __m256 s=acc[0]; for(int i=1;i<8;++i) s=_mm256_add_ps(s,acc[i]); float o[8]; _mm256_storeu_ps(o,s); return o[0];
}
T float intx_cur4(int K, int reps) {
  __m256 acc[4]; for (auto& a: acc) a=_mm256_setzero_ps();
  const __m256i ctrl=_mm256_setr_epi8(0,1,-128,-128,0,1,-128,-128,0,1,-128,-128,1,2,-128,-128,1,2,-128,-128,1,2,-128,-128,2,3,-128,-128,2,3,-128,-128);
  const __m256i sh=_mm256_setr_epi32(0,3,6,1,4,7,2,5); const __m256 t=_mm256_setr_ps(-4,-3,-2,-1,0,1,2,3);
  for (int r=0;r<reps;++r) for (int k=0;k<K;k+=32) {
#pragma GCC unroll 4
    for (int i=0;i<4;++i){ const uint8_t* b=wbuf[i]+k*3/8;
      __m256i d0=_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)b)), d1=_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(b+6)));
#pragma GCC unroll 2
      for(int h=0;h<2;++h){ __m256i d=h?d1:d0;
        acc[i]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+16*h),_mm256_permutevar8x32_ps(t,_mm256_srlv_epi32(_mm256_shuffle_epi8(d,ctrl),sh)),acc[i]);
        acc[i]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+16*h+8),_mm256_permutevar8x32_ps(t,_mm256_srlv_epi32(_mm256_shuffle_epi8(_mm256_srli_si256(d,3),ctrl),sh)),acc[i]);}} }
  __m256 s=acc[0]; for(int i=1;i<4;++i) s=_mm256_add_ps(s,acc[i]); float o[8]; _mm256_storeu_ps(o,s); return o[0];
}
T float intx_lanes4(int K, int reps) {
  __m256 acc[4]; for (auto& a: acc) a=_mm256_setzero_ps();
  const __m256i ctrl=_mm256_setr_epi8(0,1,2,-128,3,4,5,-128,6,7,8,-128,9,10,11,-128, 0,1,2,-128,3,4,5,-128,6,7,8,-128,9,10,11,-128);
  const __m256i sh=_mm256_setr_epi32(0,0,0,0,12,12,12,12); const __m256 t=_mm256_setr_ps(-4,-3,-2,-1,0,1,2,3);
  for (int r=0;r<reps;++r) for (int k=0;k<K;k+=32) {
#pragma GCC unroll 4
    for (int i=0;i<4;++i){ const uint8_t* b=wbuf[i]+k*3/8;
      __m256i d=_mm256_srlv_epi32(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)b)),ctrl),sh);
      acc[i]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k),_mm256_permutevar8x32_ps(t,d),acc[i]);
      acc[i]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+8),_mm256_permutevar8x32_ps(t,_mm256_srli_epi32(d,3)),acc[i]);
      acc[i]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+16),_mm256_permutevar8x32_ps(t,_mm256_srli_epi32(d,6)),acc[i]);
      acc[i]=_mm256_fmadd_ps(_mm256_loadu_ps(xb+k+24),_mm256_permutevar8x32_ps(t,_mm256_srli_epi32(d,9)),acc[i]);} }
  __m256 s=acc[0]; for(int i=1;i<4;++i) s=_mm256_add_ps(s,acc[i]); float o[8]; _mm256_storeu_ps(o,s); return o[0];
}
int main(int argc, char** argv) {
  const double ghz = argc > 1 ? atof(argv[1]) : 3.65;
  const int K = 1024, reps = 20000;
  float sink = 0;
  struct { const char* name; float (*f)(int, int); } loops[] = {
      {"fp8_cur", fp8_cur}, {"fp8_wide", fp8_wide}, {"nf4_cur", nf4_cur}, {"nf4_planes", nf4_planes},
      {"fp4_planes", fp4_planes}, {"intx_cur", intx_cur}, {"intx_magic", intx_magic}, {"intx_cur4", intx_cur4},
      {"intx_lanes4", intx_lanes4}};
  for (auto& l : loops) {
    const double t = now();
    sink += l.f(K, reps);
    printf("%-12s %.2f cycles / 8 weights\n", l.name, (now() - t) * ghz * 1e9 / (4.0 * K * reps / 8));
  }
  return sink == 12345.f;
}
