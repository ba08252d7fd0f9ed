"""Where dA_log's error comes from, from two emulator dumps (dev/bwd_emu/run.sh: EMU_DUMP=/tmp/emu/gTAG.bin and
EMU_DUMP_REF=/tmp/emu/rTAG.bin of `harness 128 128 1 0 2 3 2 2`, three sequences of 100 tokens, HQK = HV = 2):

    python3 dev/bwd_emu/dalog_parts.py TAG
    DALOG_SHAPE="300 4 4 1" python3 dev/bwd_emu/dalog_parts.py TAG   (T HQK HV N: another case's shape, N equal
                                                                      sequences, e.g. acc_inputs.py's in mode 5)

dλ = dg / (−e^{A_log} σ(g + dt_bias)) (the log decay's gradient), its errors by token position, Σ e·λ (dA_log's
error) by position and by |λ|, how correlated the errors are (|Σ e λ| / √Σ (e λ)²), and the ratio
rel(dA_log) / rel(dg) against what independent errors on dλ would give on these inputs (200 draws).
A throwaway reading tool: the shapes are the harness case's, fixed below.
"""
import numpy as np, os, sys
T,HQK,HV,N=map(int,os.environ.get("DALOG_SHAPE","300 2 2 3").split()); K=V=128; L=T//N
n=[T*HQK*K,T*HQK*K,T*HV*V,T*HV*K,T*HV,N*HV*K*V,HV,HV*K]
def load(f, extra=False):
    a=np.fromfile(f,dtype=np.float32); out=[]; o=0
    for m in n: out.append(a[o:o+m].astype(np.float64)); o+=m
    if extra:
        out.append(a[o:o+T*HV*K].astype(np.float64)); o+=T*HV*K
        out.append(a[o:o+HV].astype(np.float64)); o+=HV
        out.append(a[o:o+HV*K].astype(np.float64)); o+=HV*K
    return out
tag=sys.argv[1]
got=load(f"/tmp/emu/g{tag}.bin"); ref=load(f"/tmp/emu/r{tag}.bin",True)
graw,A,dtb=ref[8].reshape(T,HV,K),ref[9],ref[10].reshape(HV,K)
x=graw+dtb[None]; sp=np.where(x>0,x+np.log1p(np.exp(-x)),np.log1p(np.exp(x)))
lam=np.clip(-np.exp(A)[None,:,None]*sp,-80,0)
dg_r=ref[3].reshape(T,HV,K); dg_g=got[3].reshape(T,HV,K)
# dA_log = Σ dλ λ over tokens and channels: dλ = dg / (−e^A σ(x)), the log decay's gradient (dg is the raw gate's)
sig=1/(1+np.exp(-x)); fac=-np.exp(A)[None,:,None]*sig
dl_r=dg_r/fac; dl_g=dg_g/fac; el=dl_g-dl_r
print("dA_log ref",ref[6],"= Σ dλ·λ",(dl_r*lam).sum((0,2)),"; got",got[6],"= Σ dλ·λ",(dl_g*lam).sum((0,2)))
print("err dA_log",got[6]-ref[6]," Σ eλ·λ",(el*lam).sum((0,2))," √Σ(eλ·λ)²",np.sqrt(((el*lam)**2).sum((0,2))))
print("Σ|dλ λ| / |dA_log|", np.abs(dl_r*lam).sum((0,2))/np.abs(ref[6]))
b=np.abs(lam)
for lo,hi in [(0,0.1),(0.1,1),(1,3),(3,10),(10,100)]:
    m=(b>=lo)&(b<hi)
    if m.any():
        print(f"|λ| [{lo},{hi}): frac {m.mean():.3f}  Σ eλ·λ {(el*lam*m).sum((0,2))}  rms eλ {np.sqrt((el[m]**2).mean()):.3e} rms dλ {np.sqrt((dl_r[m]**2).mean()):.3e}")
# dgamma = dlam_t - dlam_{t+1} within sequences (3 seqs x 100)
dl_r3=dl_r.reshape(N,L,HV,K); el3=el.reshape(N,L,HV,K); lam3=lam.reshape(N,L,HV,K)
dgam_r=dl_r3.copy(); dgam_r[:,:-1]-=dl_r3[:,1:]
egam=el3.copy(); egam[:,:-1]-=el3[:,1:]
Gam=np.cumsum(lam3,axis=1)
print("check Σ dgam·Gam ref", (dgam_r*Gam).sum((0,1,3)))
print("err via Σ egam·Gam", (egam*Gam).sum((0,1,3)))
pos=np.arange(L)
for nm,m in [("t=L-1",pos==L-1),("t=63",pos==63),("t=0",pos==0),("t=64",pos==64),("others",~np.isin(pos,[0,63,64,L-1]))]:
    print(f"{nm:7s} Σ egam·Gam {(egam*Gam)[:,m].sum((0,1,3))}  rms egam {np.sqrt((egam[:,m]**2).mean()):.3e} rms dgam {np.sqrt((dgam_r[:,m]**2).mean()):.3e}  rms Gam {np.sqrt((Gam[:,m]**2).mean()):.2f}")
print("---- Σ el·lam by position")
for nm,m in [("t=L-1",pos==L-1),("t=L-2",pos==L-2),("t=63",pos==63),("t=64",pos==64),("t=0",pos==0),("t<63",pos<63),("64..L-2",(pos>=64)&(pos<L-2))]:
    print(f"{nm:7s} Σ el·lam {(el3*lam3)[:,m].sum((0,1,3))}  rms el {np.sqrt((el3[:,m]**2).mean()):.3e} rms dlam {np.sqrt((dl_r3[:,m]**2).mean()):.3e} rel {np.sqrt((el3[:,m]**2).mean()/(dl_r3[:,m]**2).mean()):.2e}")
print("---- correlation: |Σ el·lam| / sqrt(Σ (el·lam)^2)")
z=el3*lam3
for nm,m in [("all",pos>=0),("t<64",pos<64),("t>=64",pos>=64)]:
    s_=z[:,m].sum((0,1,3)); q_=np.sqrt((z[:,m]**2).sum((0,1,3)))
    print(nm, s_/q_)
# per channel sums over tokens (head 0, 1): top channels
for h in range(HV):
    zc=z[:,:,h,:].sum((0,1)); print("head",h,"total",zc.sum()," top channels", np.argsort(-np.abs(zc))[:6], np.sort(np.abs(zc))[::-1][:6])
    zt=z[:,:,h,:].sum(2); idx=np.argsort(-np.abs(zt.ravel()))[:8]; print("   top tokens (seq,pos)", [(i//L,i%L,round(float(zt.ravel()[i]),6)) for i in idx])
print("---- iid-on-dλ amplification for these inputs")
amps=[]
rng=np.random.default_rng(0)
for r in range(200):
    e_=1e-3*dl_r*rng.standard_normal(dl_r.shape)
    relA=np.linalg.norm((e_*lam).sum((0,2)))/np.linalg.norm(ref[6]); reldg=np.linalg.norm(e_*fac)/np.linalg.norm(dg_r)
    amps.append(relA/reldg)
amps=np.array(amps); print("iid median %.2f 10-90%% %.2f-%.2f"%(np.median(amps),np.quantile(amps,.1),np.quantile(amps,.9)))
print("measured ratio rel(dA_log)/rel(dg): %.2f"%((np.linalg.norm(got[6]-ref[6])/np.linalg.norm(ref[6]))/(np.linalg.norm(dg_g-dg_r)/np.linalg.norm(dg_r))))
print("---- Σ el·lam by position within the chunk (r = t mod 64)")
r_=pos%64
for nm,m in [("r=63",r_==63),("r=62",r_==62),("r=0",r_==0),("r 1..61",(r_>=1)&(r_<=61)),("last token",pos==L-1)]:
    print(f"{nm:10s} Σ el·lam {(el3*lam3)[:,m].sum((0,1,3))}  rms el {np.sqrt((el3[:,m]**2).mean()):.3e} rms dlam {np.sqrt((dl_r3[:,m]**2).mean()):.3e}")
