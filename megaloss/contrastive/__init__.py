"""Contrastive losses: gathered Multiple Negatives Ranking (InfoNCE) with exact cross-rank
gradients."""
from .mnr import SIMILARITIES, MNROutput, mnr_loss, mnr_loss_with_metrics
from .module import MultipleNegativesRankingLoss

__all__ = ["mnr_loss", "mnr_loss_with_metrics", "MNROutput", "MultipleNegativesRankingLoss",
           "SIMILARITIES"]
