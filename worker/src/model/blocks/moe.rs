//! A mixture of gated-MLP experts (Qwen3-MoE): a router picks each row's top-k experts, every
//! active expert runs once over all the rows sent to it, and each row gets its experts'
//! outputs weighted by their router probabilities; plus, in Qwen3-Next, a shared expert every
//! row runs, weighted by its own sigmoid gate.

use baton_shared::model_files::LoadError;

use super::super::arch::MoeTensors;
use super::super::loader::WeightLoader;
use super::super::scratch::Scratch;
use super::GatedMlp;
use crate::ops::Ops;

/// A routed mixture of experts.
pub struct SparseMoe<O: Ops> {
    /// `[experts, hidden]`, kept in f32 (as llama.cpp keeps it) so rounding never changes
    /// which experts a row picks.
    router: O::Mat,
    experts: Vec<GatedMlp<O>>,
    top_k: usize,
    normalize: bool,
    /// The shared expert and its `[1, hidden]` gate (f32, like the router).
    shared: Option<(GatedMlp<O>, O::Mat)>,
    /// The experts prepared to run in one go, where the device has such a path.
    one_go: Option<O::Experts>,
}

impl<O: Ops> SparseMoe<O> {
    /// Load the router and every expert `t` names.
    pub fn load(w: &WeightLoader<'_, O>, t: &MoeTensors) -> Result<Self, LoadError> {
        let experts: Vec<GatedMlp<O>> = t
            .experts
            .iter()
            .map(|e| GatedMlp::load(w, e))
            .collect::<Result<_, _>>()?;
        let mats: Vec<[&O::Mat; 3]> = experts.iter().map(|e| e.matrices()).collect();
        let one_go = w.ops.experts(&mats);
        Ok(Self {
            router: w.table(&t.router)?,
            experts,
            one_go,
            top_k: t.top_k,
            normalize: t.normalize,
            shared: match &t.shared {
                Some(s) => Some((GatedMlp::load(w, &s.mlp)?, w.table(&s.gate)?)),
                None => None,
            },
        })
    }

    /// Whether the device routes this mixture on itself: its experts run in one go and the
    /// device can route that many experts (so the host never waits mid-forward).
    pub fn routes_on_device(&self, ops: &O) -> bool {
        self.one_go.is_some() && ops.routes_on_device(self.experts.len(), self.top_k)
    }

    /// `s.proj = moe(s.xn)`.
    pub fn forward(&self, ops: &O, s: &mut Scratch<O>) {
        ops.matmul(&mut s.ws, &s.xn, &self.router, None, &mut s.router);
        let (experts, top_k) = (self.experts.len(), self.top_k);
        match self.routes_on_device(ops) {
            true => ops.route_on_device(&s.router, experts, top_k, self.normalize, &mut s.routing),
            false => ops.route(&s.router, experts, top_k, self.normalize, &mut s.routing),
        }
        s.moe.layers += 1;
        if let Some(experts) = &self.one_go {
            let scratch = [&mut s.gate, &mut s.up, &mut s.expert_out];
            if let Some(active) = ops.routed_experts(&mut s.ws, &s.xn, &s.routing, experts, scratch, &mut s.proj) {
                s.moe.active_experts += active;
                s.moe.counted_layers += 1;
            }
            s.moe.one_go_layers += 1;
        } else {
            let len = ops.len(&s.xn);
            ops.zeros(&mut s.proj, len);
            for (e, expert) in self.experts.iter().enumerate() {
                if ops.gather_routed(&s.xn, &s.routing, e, &mut s.expert_in) == 0 {
                    continue;
                }
                s.moe.active_experts += 1;
                expert.apply(ops, &mut s.ws, &s.expert_in, &mut s.gate, &mut s.up, &mut s.expert_out);
                ops.scatter_routed(&s.expert_out, &s.routing, e, &mut s.proj);
            }
            s.moe.counted_layers += 1;
        }
        if let Some((expert, gate)) = &self.shared {
            expert.apply(ops, &mut s.ws, &s.xn, &mut s.gate, &mut s.up, &mut s.expert_out);
            ops.matmul(&mut s.ws, &s.xn, gate, None, &mut s.router);
            ops.add_sigmoid_scaled(&mut s.proj, &s.expert_out, &s.router);
        }
    }

    /// Every routed expert's gate, up and down, in expert order.
    pub fn matrices(&self) -> impl Iterator<Item = &O::Mat> {
        self.experts.iter().flat_map(|e| e.matrices())
    }

    /// The shared expert's gate, up and down (every row reads them).
    pub fn shared_matrices(&self) -> impl Iterator<Item = &O::Mat> {
        self.shared.iter().flat_map(|(e, _)| e.matrices())
    }

    /// The shared expert's gate vector, if there is one.
    pub fn shared_gate(&self) -> Option<&O::Mat> {
        self.shared.as_ref().map(|(_, g)| g)
    }

    /// The router.
    pub fn router(&self) -> &O::Mat {
        &self.router
    }

    /// Experts in the layer.
    pub fn experts(&self) -> usize {
        self.experts.len()
    }

    /// Experts each row is sent to.
    pub fn top_k(&self) -> usize {
        self.top_k
    }
}
