// Page-cache bounds of a checkpoint load and save on this machine: N threads read or write
// one file (mmap, pread/pwrite, populated first, over cached pages, preallocated with
// fallocate first, huge pages asked for) or a file each.
//   cc -O2 -pthread -o /tmp/pagecache-bounds benches/pagecache-bounds.c
//   /tmp/pagecache-bounds DIR GIB THREADS...    (e.g. /tmp 2 1 4 8 16; the file is removed)
// Modes past the eighth were added 2026-12-07; MODES=a,b (indices) runs only those.
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#define MADV_POPULATE_WRITE 23
#endif
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct {int mode,fd;char*map;char*buf;size_t off,len;} job;
enum {MAPW, PWRITE, MAPR, PREAD, POPW, POPR, REWRITE, FILESW, FMAPW, FPOPW, FPWRITE, HUGEW, NMODES};
static void*work(void*p){job*j=p;size_t c=4<<20;
 for(size_t o=0;o<j->len;o+=c){size_t n=j->len-o<c?j->len-o:c;
  switch(j->mode){
  case MAPW: case FMAPW: case HUGEW: memcpy(j->map+j->off+o,j->buf,n);break;
  case POPW: case FPOPW: madvise(j->map+j->off+o,n,MADV_POPULATE_WRITE);memcpy(j->map+j->off+o,j->buf,n);break;
  case PWRITE: case FPWRITE: if(pwrite(j->fd,j->buf,n,j->off+o)!=(ssize_t)n)perror("pwrite");break;
  case MAPR: memcpy(j->buf,j->map+j->off+o,n);break;
  case POPR: madvise(j->map+j->off+o,n,MADV_POPULATE_READ);memcpy(j->buf,j->map+j->off+o,n);break;
  case REWRITE: if(pwrite(j->fd,j->buf,n,j->off+o)!=(ssize_t)n)perror("rewrite");break;
  case FILESW: if(pwrite(j->fd,j->buf,n,o)!=(ssize_t)n)perror("filesw");break;
  case PREAD: if(pread(j->fd,j->buf,n,j->off+o)!=(ssize_t)n)perror("pread");break;}}
 return 0;}
static const char*names[]={"mmap-write","pwrite","mmap-read","pread","populate+mmap-write","populate+mmap-read","pwrite-over-cached","pwrite-own-files",
 "fallocate+mmap-write","fallocate+populate+write","fallocate+pwrite","madv-hugepage+mmap-write"};
static int wanted(int mode){const char*m=getenv("MODES");if(!m)return 1;
 char b[256];snprintf(b,sizeof b,",%s,",m);char k[16];snprintf(k,sizeof k,",%d,",mode);return strstr(b,k)!=0;}
int main(int argc,char**argv){const char*dir=argv[1];size_t sz=(size_t)(atof(argv[2])*(1ul<<30));
 char path[512];snprintf(path,sizeof path,"%s/pcw.bin",dir);
 for(int a=3;a<argc;a++){int T=atoi(argv[a]);
  for(int mode=0;mode<NMODES;mode++){
   if(!wanted(mode))continue;
   int write=(mode==MAPW||mode==PWRITE||mode==POPW||mode>=FMAPW);
   int fd;
   if(write){unlink(path);fd=open(path,O_RDWR|O_CREAT|O_TRUNC,0644);if(ftruncate(fd,sz))perror("ftruncate");
    if(mode>=FMAPW&&mode<=FPWRITE&&fallocate(fd,0,0,sz))perror("fallocate");}
   else{fd=open(path,O_RDWR);}
   char*map=mmap(0,sz,PROT_READ|PROT_WRITE,MAP_SHARED,fd,0);
   if(mode==HUGEW&&madvise(map,sz,MADV_HUGEPAGE))perror("madvise(MADV_HUGEPAGE)");
   pthread_t th[256];job js[256];size_t per=sz/T;
   for(int t=0;t<T;t++){int f=fd;if(mode==FILESW){char q[600];snprintf(q,sizeof q,"%s.%d",path,t);unlink(q);f=open(q,O_RDWR|O_CREAT|O_TRUNC,0644);}
    js[t]=(job){mode,f,map,aligned_alloc(4096,4<<20),per*t,per};memset(js[t].buf,t+1,4<<20);}
   double t0=now();
   for(int t=0;t<T;t++)pthread_create(&th[t],0,work,&js[t]);
   for(int t=0;t<T;t++)pthread_join(th[t],0);
   double dt=now()-t0;
   printf("%s threads %2d %-26s %6.2f GB/s\n",dir,T,names[mode],sz/dt/1e9);fflush(stdout);
   munmap(map,sz);close(fd);if(mode==FILESW)for(int t=0;t<T;t++){char q[600];snprintf(q,sizeof q,"%s.%d",path,t);close(js[t].fd);unlink(q);}for(int t=0;t<T;t++)free(js[t].buf);}}
 unlink(path);return 0;}
