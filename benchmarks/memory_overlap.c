/* Reads the K/V blocks of a W64-like decode step (64 sequences x 22 blocks of 12 KB, K and V,
 * random block order, 30 layers) with WORK independent multiply-adds per 128 bytes between
 * the loads, prefetching PF blocks ahead (HINT 1: prefetcht1, 0: prefetcht0): how much read
 * bandwidth is left once the cores have arithmetic to do (docs/benchmarks.md, Zen 4 round).
 *   gcc -O2 -mavx512f -mfma -fopenmp benchmarks/memory_overlap.c -o /tmp/overlap
 *   OMP_NUM_THREADS=2 /tmp/overlap WORK PF HINT     (e.g. 0 4 1, then 16 4 1) */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* 64 seqs x 22 blocks of 12 KB (K and V), random block order, 30 layers; per 64 B line `work` dependent-free FMAs */
int main(int argc,char**argv){
  int work=atoi(argv[1]); int pf=atoi(argv[2]); int hint=atoi(argv[3]);
  const int64_t seqs=64, nb=22, layers=30, blk=12288;
  const int64_t nblocks=seqs*nb*layers+1;
  char*K=aligned_alloc(64,nblocks*blk),*V=aligned_alloc(64,nblocks*blk); memset(K,1,nblocks*blk); memset(V,1,nblocks*blk);
  int32_t*tab=malloc(nblocks*4); for(int64_t i=0;i<nblocks-1;i++)tab[i]=i+1;
  srand(1); for(int64_t i=nblocks-2;i>0;i--){int64_t j=rand()%(i+1);int32_t t=tab[i];tab[i]=tab[j];tab[j]=t;}
  double best=1e9; float sink=0;
  for(int rep=0;rep<5;rep++){ double t0=now();
   for(int l=0;l<layers;l++){
    #pragma omp parallel for schedule(dynamic,1) reduction(+:sink)
    for(int64_t s=0;s<seqs;s++){ const int32_t*tb=tab+(l*seqs+s)*nb;
      __m512 a[8]; for(int i=0;i<8;i++)a[i]=_mm512_set1_ps(0.f); __m512 m=_mm512_set1_ps(1.0001f);
      for(int64_t b=0;b<nb;b++){ const char*kb=K+(int64_t)tb[b]*blk,*vb=V+(int64_t)tb[b]*blk;
        const char*nk=0,*nv=0; if(b+pf<nb){nk=K+(int64_t)tb[b+pf]*blk; nv=V+(int64_t)tb[b+pf]*blk;}
        for(int64_t x=0;x<blk;x+=64){
          if(nk){ if(hint==1){_mm_prefetch(nk+x,_MM_HINT_T1);_mm_prefetch(nv+x,_MM_HINT_T1);} else {_mm_prefetch(nk+x,_MM_HINT_T0);_mm_prefetch(nv+x,_MM_HINT_T0);} }
          __m512 k=_mm512_load_ps((const float*)(kb+x)), v=_mm512_load_ps((const float*)(vb+x));
          a[0]=_mm512_add_ps(a[0],k); a[1]=_mm512_add_ps(a[1],v);
          for(int w=0;w<work;w++){ a[2+(w%6)]=_mm512_fmadd_ps(a[2+(w%6)],m,k); }
        }}
      for(int i=1;i<8;i++)a[0]=_mm512_add_ps(a[0],a[i]); sink+=_mm512_reduce_add_ps(a[0]);
    }}
   double dt=now()-t0; if(dt<best)best=dt;}
  double bytes=2.0*seqs*nb*blk*layers;
  printf("work %d pf %d hint %s: %.2f GB/s\n",work,pf,hint?"T1":"T0",bytes/best/1e9);
}
