import hf_fuzz, torch
from fastverify.hf import patch, unpatch, Drafter
cap = {}
orig = hf_fuzz._generate
def gen(model, ids, mask, opts):
    cap.update(model=model, ids=ids, mask=mask, opts=dict(opts)); return orig(model, ids, mask, opts)
hf_fuzz._generate = gen
r = hf_fuzz.run_case(10039, kinds=('heads','eagle','slots'))
m, ids, mask, opts = cap["model"], cap["ids"], cap["mask"], cap["opts"]
unpatch(m)
print(ids.shape, opts)
print("row3 ids", ids[3].tolist())
o = m.generate(ids, attention_mask=mask, pad_token_id=1, output_scores=True, return_dict_in_generate=True, output_logits=True, **opts)
print("gen", o.sequences[3, ids.shape[1]:].tolist())
print("scores step0 row3 [:6]", o.scores[0][3, :6].tolist(), "raw", o.logits[0][3,:6].tolist())
patch(m, drafter=Drafter())
o2 = m.generate(ids, attention_mask=mask, pad_token_id=1, **opts)
print("loop nodraft", o2[3, ids.shape[1]:].tolist())
